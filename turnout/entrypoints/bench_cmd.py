"""`turnout bench latency | throughput`: vLLM-style benchmarks on random token prompts (ignore_eos).
(`turnout bench serve`, which loads a running server instead, lives in bench_serve.py.)
This module parses the flags, builds the engine and assembles the result; the timed steps and the figures
made of them are bench_measure.py's, the result's fields and printed table bench_report.py's.

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
import gc
import json
import logging
import sys
import time
from pathlib import Path

from turnout.entrypoints import bench_serve
from turnout.entrypoints.bench_measure import bench_latency, bench_throughput
from turnout.entrypoints.bench_models import bench_tokenizer, resolve_model
from turnout.entrypoints.bench_report import print_report
from turnout.entrypoints.bench_serve_metrics import json_safe as _clean
from turnout.entrypoints.engine_args import add_engine_args, add_vllm_noop_args, engine_kwargs, note_vllm_noop_args
from turnout.utils.gc_freeze import freeze_startup_heap

logger = logging.getLogger(__name__)

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


def _ratio(x, ceiling):
    return x / ceiling if x is not None and ceiling else None


def speculative_report(config, stats) -> dict | None:
    """The run's speculative decoding (warm-up included): the method, k and the draft counters; None when off."""
    spec = getattr(config, "speculative", None)
    if spec is None:
        return None
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens, "draft_model": spec.model,
            "num_drafts": stats.num_drafts_total, "num_draft_tokens": stats.draft_tokens_total,
            "num_accepted_tokens": stats.accepted_draft_tokens_total,
            "mean_accepted_length": stats.mean_accepted_length,
            "acceptance_per_position": stats.draft_acceptance_per_position}


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
    freeze_startup_heap()  # the measured steps scan no start-up objects (turnout/utils/gc_freeze.py) ...
    try:
        measured = bench_latency(args, llm, geo) if args.bench == "latency" else bench_throughput(args, llm, geo)
    finally:
        gc.unfreeze()  # ... and a caller that goes on in this process (tests) gets its collector back
    result.update(measured)
    copy_bw, gemm = ceilings.get("copy_GB_s"), ceilings.get("gemm_TFLOP_s")
    result["frac_of_copy_bw"] = _ratio(result["achieved_GB_s"], copy_bw)
    result["frac_of_gemm"] = _ratio(result["achieved_TFLOP_s"], gemm)
    if args.bench == "latency":
        result["decode_frac_of_copy_bw"] = _ratio(result["decode_GB_s"], copy_bw)
        result["prefill_frac_of_gemm"] = _ratio(result["prefill_TFLOP_s"], gemm)
    graphs = eng.runner.graphs.stats() if getattr(eng.runner, "graphs", None) is not None else graphs
    result["speculative"] = speculative_report(eng.config, eng.get_stats())
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
