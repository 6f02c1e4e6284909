"""`turnout bench latency | throughput`: vLLM-style benchmarks on random token prompts (ignore_eos).
(`turnout bench serve`, which loads a running server instead, lives in bench_serve.py.)

latency: ``--batch-size`` prompts of ``--input-len`` tokens, ``--output-len`` tokens each, ``--num-iters``
times (fresh prompts each time, so the prefix cache never helps). Every ``engine.step()`` is timed: the
steps that process prompt tokens are prefill, the others decode.
throughput: ``--num-prompts`` prompts at once; output and total tokens/s.

Beside tokens/s each prints achieved GB/s (weights read per step + KV read) and TFLOP/s (2 x params x
tokens + attention), and their ratio to the copy bandwidth and GEMM rate measured in the same run
(``turnout/utils/roofline.py``), as a table and as one JSON object (``--output-json PATH`` also writes it).

``--model`` is a model directory or file, or the name of a config in ``benchmarks/configs/`` (a directory
holding ``config.json``, or a ``<name>.json`` file): those get dummy weights.

    turnout bench latency --model qwen3-8b --batch-size 1 --input-len 128 --output-len 256
    python -m turnout.entrypoints.bench_cmd throughput --model qwen3-8b --num-prompts 512 ...
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

from turnout.entrypoints import bench_serve
from turnout.entrypoints.bench_models import (  # noqa: F401
    NullTokenizer,
    bench_tokenizer,
    config_roots,
    has_tokenizer_files,
    random_prompts,
    resolve_model,
)
from turnout.entrypoints.bench_serve_metrics import json_safe as _clean
from turnout.entrypoints.engine_args import add_engine_args, add_vllm_noop_args, engine_kwargs, note_vllm_noop_args
from turnout.kv.stats import format_tiers, tier_report

logger = logging.getLogger(__name__)

# Fields every JSON result carries (tests check them; docs/gpu.md explains them).
COMMON_FIELDS = ("bench", "model", "model_path", "load_format", "dtype", "device", "input_len", "output_len",
                 "enforce_eager", "cuda_graphs", "ops", "engine", "geometry", "ceilings", "machine",
                 "achieved_GB_s", "achieved_TFLOP_s", "frac_of_copy_bw", "frac_of_gemm", "kv_tiers")
LATENCY_FIELDS = COMMON_FIELDS + ("batch_size", "num_iters", "latency_s", "latency_p50_s", "latency_p90_s",
                                  "latencies_s", "prefill_s", "prefill_tok_s", "prefill_TFLOP_s",
                                  "prefill_frac_of_gemm", "decode_step_ms", "decode_step_p50_ms",
                                  "decode_step_p90_ms", "decode_tok_s", "decode_GB_s", "decode_TFLOP_s",
                                  "decode_frac_of_copy_bw", "output_tok_s")
THROUGHPUT_FIELDS = COMMON_FIELDS + ("num_prompts", "elapsed_s", "requests_per_s", "output_tok_s",
                                     "total_tok_s", "num_steps", "num_prefill_steps", "num_decode_steps",
                                     "prefill_steps_s", "decode_steps_s", "decode_step_ms", "mean_decode_batch",
                                     "num_preemptions")


# A benchmark's engine: one process, and a model that answers to no name.
BENCH_EXCLUDED = ("model", "served_model_name", "data_parallel_size")
BENCH_HELPS = {
    "load_format": "how to read the weights (bundled configs: dummy)",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes (default: off: random prompts)",
    "max_num_seqs": "sequences generated at once (default: latency: --batch-size; throughput: as many as the "
                    "KV cache holds)",
    "max_num_batched_tokens": "tokens in one step (default: latency: batch x input-len in [2048, 32768]; "
                              "throughput: 16384 on a GPU, 2048 on CPU)",
    "max_model_len": "context length (default: input-len + output-len)",
    "tokenizer": "a tokenizer other than the model's (default: the model's, or none for a bundled config)",
}


def _common(p) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model directory/file, or a name from benchmarks/configs (qwen3-8b, llama-3.1-8b, ...)")
    p.add_argument("--model", dest="model_flag", metavar="MODEL", default=None,
                   help="the same as the positional MODEL (vLLM's spelling); give one of the two")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    add_engine_args(p, exclude=BENCH_EXCLUDED, helps=BENCH_HELPS,
                    defaults={"enable_prefix_caching": False, "max_num_batched_tokens": None})
    add_vllm_noop_args(p)
    p.add_argument("--ceilings", action=argparse.BooleanOptionalAction, default=True,
                   help="measure copy bandwidth and GEMM rate first (default: on; --no-ceilings skips them)")
    p.add_argument("--output-json", default=None, metavar="PATH")


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    lat = sub.add_parser("latency", help="time one batch: prefill and per-step decode")
    _common(lat)
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    thr = sub.add_parser("throughput", help="offline throughput of many prompts")
    _common(thr)
    thr.add_argument("--num-prompts", type=int, default=256)
    srv = sub.add_parser("serve", help="load a running OpenAI-compatible server (vllm bench serve)",
                         description=bench_serve.__doc__.split("\n\n")[0])
    bench_serve.add_arguments(srv)


def _resolve_model_arg(args) -> None:
    """MODEL given as the positional or as --model; both, differing, is a mistake."""
    flag = args.model_flag
    if flag is not None and args.model is not None and flag != args.model:
        raise ValueError(f"--model: the model is given twice ({args.model!r} and --model {flag!r}); give one")
    args.model = args.model if args.model is not None else flag


def _validate(args) -> None:
    _resolve_model_arg(args)
    for name in ("input_len", "output_len") + (("batch_size", "num_iters") if args.bench == "latency"
                                               else ("num_prompts",)):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")


# ---- engine --------------------------------------------------------------------------------------
def build_llm(args, batch: int):
    """The LLM for a benchmark run, and the wall time it took to start."""
    from turnout.engine.llm import LLM

    path, bundled = resolve_model(args.model)
    load_format = args.load_format
    if bundled and load_format == "auto":
        load_format = "dummy"
    on_gpu = _on_gpu(args.device)
    max_seqs = args.max_num_seqs or (batch if args.bench == "latency" else None)  # None: what the cache holds
    max_tokens = args.max_num_batched_tokens
    if max_tokens is None:
        max_tokens = (min(max(2048, batch * args.input_len), 32768) if args.bench == "latency"
                      else (16384 if on_gpu else 2048))
    t0 = time.perf_counter()
    note_vllm_noop_args(args)
    options = engine_kwargs(args, exclude=BENCH_EXCLUDED)
    options.update(load_format=load_format, max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                   max_model_len=args.max_model_len or args.input_len + args.output_len,
                   tokenizer=args.tokenizer or bench_tokenizer(path))
    llm = LLM(model=path, **options)
    return llm, path, load_format, time.perf_counter() - t0


def _on_gpu(device: str) -> bool:
    from turnout.platforms import detect_platform

    return detect_platform(device).is_gpu


def _ceilings(args, dtype) -> dict:
    from turnout.platforms import detect_platform
    from turnout.utils.roofline import measure_ceilings

    if not args.ceilings:
        return {"copy_GB_s": None, "gemm_TFLOP_s": None, "skipped": True}
    platform = detect_platform(args.device)
    return measure_ceilings(platform.device(0 if platform.is_gpu else None), dtype)


def _engine_info(llm, startup_s: float) -> tuple[dict, dict, dict]:
    eng = llm.engine
    runner = eng.runner
    graphs = getattr(runner, "graphs", None)
    if graphs is not None:
        g = graphs.stats()
    else:
        g = {"enabled": False, "disabled_reason": "enforce_eager" if eng.config.enforce_eager
             else f"not supported on {eng.platform.name}"}
    info = {"startup_s": startup_s, "platform": eng.platform.name, "description": eng.platform.description,
            "num_kv_blocks": runner.num_blocks, "kv_cache_GiB": runner.num_blocks * runner.block_bytes / 2**30,
            "block_size": runner.block_size, "max_model_len": eng.max_model_len,
            "max_num_seqs": eng.config.max_num_seqs, "max_num_batched_tokens": eng.config.max_num_batched_tokens,
            "async_scheduling": eng.async_scheduling, "pdl": runner.pdl}
    ops = {name: res.chosen for name, res in eng.ops.resolutions.items()}
    return info, g, ops


class _Step:
    __slots__ = ("dt", "prompt_tokens", "gen_tokens")

    def __init__(self, dt, prompt_tokens, gen_tokens):
        self.dt, self.prompt_tokens, self.gen_tokens = dt, prompt_tokens, gen_tokens

    @property
    def is_prefill(self) -> bool:
        return self.prompt_tokens > 0


def run_to_completion(engine, prompts, params, tag: str) -> tuple[list[_Step], float]:
    """Add every prompt, step until all finish; time each step (a step ends in the sampled tokens'
    device->host copy, so its wall time is its GPU time plus host work)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    steps: list[_Step] = []
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        before = engine.get_stats()
        t0 = time.perf_counter()
        engine.step(finished_only=True)  # as LLM.generate: results only at the end
        dt = time.perf_counter() - t0
        after = engine.get_stats()
        steps.append(_Step(dt, after.prompt_tokens_total - before.prompt_tokens_total,
                           after.generation_tokens_total - before.generation_tokens_total))
    return steps, time.perf_counter() - t_start


def _ratio(x, ceiling):
    return x / ceiling if x is not None and ceiling else None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _div(a, b):
    return a / b if b else None


# ---- the two benchmarks --------------------------------------------------------------------------
def bench_latency(args, llm, geo) -> dict:
    from turnout.engine.sampling_params import SamplingParams
    from turnout.utils.roofline import prefill_attn_pairs

    eng = llm.engine
    vocab = eng.runner.vocab_size
    B, L, O = args.batch_size, args.input_len, args.output_len
    for w in range(args.num_iters_warmup):
        run_to_completion(eng, random_prompts(B, L, vocab, args.seed + 1000 + w),
                          SamplingParams(max_tokens=min(O, 8), temperature=0.0, ignore_eos=True), f"warmup{w}")
    params = SamplingParams(max_tokens=O, temperature=0.0, ignore_eos=True)
    before = eng.get_stats()
    latencies, prefills, decode_steps, decode_times = [], [], [], []
    decode_bytes = decode_flops = 0.0
    for it in range(args.num_iters):
        steps, total = run_to_completion(eng, random_prompts(B, L, vocab, args.seed + it), params, f"it{it}")
        latencies.append(total)
        prefills.append(sum(s.dt for s in steps if s.is_prefill))
        dsteps = [s for s in steps if not s.is_prefill]
        decode_steps += [s.dt for s in dsteps]
        decode_times.append(sum(s.dt for s in dsteps))
        for k, s in enumerate(dsteps, start=1):  # decode step k attends to L + k tokens per sequence
            n = s.gen_tokens or B
            decode_bytes += geo.weight_bytes_per_step(n) + n * (L + k + 1) * geo.kv_bytes_per_token
            decode_flops += geo.flops(n, n, n * (L + k))
    iters = args.num_iters
    decode_time = sum(decode_times)
    prefill_mean = statistics.fmean(prefills)
    prefill_flops = geo.flops(B * L, B, B * prefill_attn_pairs(L))
    step_mean = statistics.fmean(decode_steps) if decode_steps else None
    r = {"batch_size": B, "num_iters": iters, "latency_s": statistics.fmean(latencies),
         "latency_p50_s": _pct(latencies, 0.5), "latency_p90_s": _pct(latencies, 0.9), "latencies_s": latencies,
         "prefill_s": prefill_mean, "prefill_tok_s": _div(B * L, prefill_mean),
         "prefill_TFLOP_s": _div(prefill_flops / 1e12, prefill_mean),
         "decode_step_ms": step_mean * 1e3 if step_mean else None,
         "decode_step_p50_ms": (_pct(decode_steps, 0.5) or 0) * 1e3 if decode_steps else None,
         "decode_step_p90_ms": (_pct(decode_steps, 0.9) or 0) * 1e3 if decode_steps else None,
         "decode_tok_s": _div(B, step_mean), "decode_GB_s": _div(decode_bytes / 1e9, decode_time),
         "decode_TFLOP_s": _div(decode_flops / 1e12, decode_time),
         "output_tok_s": _div(B * O, statistics.fmean(latencies)),
         "kv_tiers": tier_report(eng.get_stats(), before, eng.runner.kv_transfer)}
    r["achieved_GB_s"], r["achieved_TFLOP_s"] = r["decode_GB_s"], r["decode_TFLOP_s"]
    return r


def bench_throughput(args, llm, geo) -> dict:
    from turnout.engine.sampling_params import SamplingParams
    from turnout.utils.roofline import decode_attn_pairs, prefill_attn_pairs

    eng = llm.engine
    vocab = eng.runner.vocab_size
    N, L, O = args.num_prompts, args.input_len, args.output_len
    warm = min(N, 8)  # compiles the prefill and decode kernels before the clock starts
    run_to_completion(eng, random_prompts(warm, L, vocab, args.seed + 1000),
                      SamplingParams(max_tokens=min(O, 4), temperature=0.0, ignore_eos=True), "warmup")
    before = eng.get_stats()
    steps, elapsed = run_to_completion(eng, random_prompts(N, L, vocab, args.seed),
                                       SamplingParams(max_tokens=O, temperature=0.0, ignore_eos=True), "req")
    gen = sum(s.gen_tokens for s in steps)
    dsteps = [s for s in steps if not s.is_prefill]
    weight_bytes = sum(geo.weight_bytes_per_step(s.prompt_tokens + s.gen_tokens) for s in steps)
    kv_tokens = N * (decode_attn_pairs(L, O) + L + (L + O))  # decode reads + prefill reads + writes
    total_bytes = weight_bytes + kv_tokens * geo.kv_bytes_per_token
    flops = geo.flops(N * (L + O - 1), N * O, N * (prefill_attn_pairs(L) + decode_attn_pairs(L, O)))
    dtime = sum(s.dt for s in dsteps)
    r = {"num_prompts": N, "elapsed_s": elapsed, "requests_per_s": N / elapsed, "output_tok_s": gen / elapsed,
         "total_tok_s": (N * L + gen) / elapsed, "num_steps": len(steps),
         "num_prefill_steps": len(steps) - len(dsteps), "num_decode_steps": len(dsteps),
         "prefill_steps_s": sum(s.dt for s in steps if s.is_prefill), "decode_steps_s": dtime,
         "decode_step_ms": _div(dtime * 1e3, len(dsteps)),
         "mean_decode_batch": _div(sum(s.gen_tokens for s in dsteps), len(dsteps)),
         "num_preemptions": eng.get_stats().num_preemptions_total - before.num_preemptions_total,
         "kv_tiers": tier_report(eng.get_stats(), before, eng.runner.kv_transfer),
         "achieved_GB_s": total_bytes / 1e9 / elapsed, "achieved_TFLOP_s": flops / 1e12 / elapsed}
    return r


# ---- output --------------------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.1f}"
    return "-" if v is None else str(v)


TABLE = {"latency": ("latency_s", "prefill_s", "prefill_tok_s", "prefill_TFLOP_s", "prefill_frac_of_gemm",
                     "decode_step_ms", "decode_step_p90_ms", "decode_tok_s", "output_tok_s", "decode_GB_s",
                     "decode_frac_of_copy_bw", "decode_TFLOP_s"),
         "throughput": ("elapsed_s", "requests_per_s", "output_tok_s", "total_tok_s", "num_steps",
                        "decode_step_ms", "mean_decode_batch", "num_preemptions", "achieved_GB_s",
                        "frac_of_copy_bw", "achieved_TFLOP_s", "frac_of_gemm")}


def print_report(result: dict, out=None) -> None:
    out = out or sys.stdout
    g = result["cuda_graphs"]
    head = (f"== turnout bench {result['bench']}: {result['model']} ({result['dtype']}, {result['device']}), "
            f"input {result['input_len']}, output {result['output_len']}, "
            + (f"batch {result['batch_size']}" if result["bench"] == "latency" else f"{result['num_prompts']} prompts")
            + f", CUDA graphs {'on' if g.get('enabled') else 'off (' + str(g.get('disabled_reason')) + ')'}")
    print(head, file=out)
    keys = TABLE[result["bench"]]
    w = max(len(k) for k in keys)
    for k in keys:
        print(f"  {k:<{w}}  {_fmt(result.get(k))}", file=out)
    c = result["ceilings"]
    print(f"  ceilings: copy {_fmt(c.get('copy_GB_s'))} GB/s, GEMM {_fmt(c.get('gemm_TFLOP_s'))} TFLOP/s "
          f"({c.get('gemm_dtype', '-')})", file=out)
    if result.get("kv_tiers"):
        print(f"  kv tiers: {format_tiers(result['kv_tiers'])}", file=out)
    print("JSON " + json.dumps(result), file=out)


def run(args) -> int:
    if args.bench == "serve":  # no engine here: it drives a server over HTTP
        return bench_serve.run(args)
    import torch

    from turnout.utils.roofline import machine, model_geometry

    _validate(args)
    batch = args.batch_size if args.bench == "latency" else args.num_prompts
    dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "half": torch.float16, "fp16": torch.float16}.get(args.dtype)
    ceilings = _ceilings(args, dtype)  # before the engine takes the memory
    llm, path, load_format, startup_s = build_llm(args, batch)
    eng = llm.engine
    geo = model_geometry(eng.runner.model, eng.hf_config, eng.runner.dtype)
    info, graphs, ops = _engine_info(llm, startup_s)
    result = {"bench": args.bench, "model": args.model or eng.model_name, "model_path": path,
              "load_format": load_format, "dtype": str(eng.runner.dtype).replace("torch.", ""),
              "device": eng.platform.description or eng.platform.name, "input_len": args.input_len,
              "output_len": args.output_len, "enforce_eager": bool(args.enforce_eager)}
    measured = bench_latency(args, llm, geo) if args.bench == "latency" else bench_throughput(args, llm, geo)
    result.update(measured)
    copy_bw, gemm = ceilings.get("copy_GB_s"), ceilings.get("gemm_TFLOP_s")
    result["frac_of_copy_bw"] = _ratio(result["achieved_GB_s"], copy_bw)
    result["frac_of_gemm"] = _ratio(result["achieved_TFLOP_s"], gemm)
    if args.bench == "latency":
        result["decode_frac_of_copy_bw"] = _ratio(result["decode_GB_s"], copy_bw)
        result["prefill_frac_of_gemm"] = _ratio(result["prefill_TFLOP_s"], gemm)
    graphs = eng.runner.graphs.stats() if getattr(eng.runner, "graphs", None) is not None else graphs
    result.update({"cuda_graphs": graphs, "ops": ops, "engine": info, "geometry": geo.to_dict(),
                   "ceilings": ceilings, "machine": machine()})
    result = _clean(result)
    print_report(result)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m turnout.entrypoints.bench_cmd latency ...`: the same, without the other subcommands'
    imports (for machines that lack the server's dependencies)."""

    p = argparse.ArgumentParser(prog="turnout bench", description="latency / throughput / serve benchmarks")
    p.add_argument("--log-level", default="INFO")
    add_arguments(p)
    from turnout.entrypoints.cli import parse_args

    args = parse_args(p, argv)
    args.command = "bench"
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(run(args) or 0)
    except ValueError as e:
        print(f"turnout bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
