"""The transformers backend against the native class on the same model (the target: at least 90 % of native on
both figures), dummy weights:

    python benchmarks/hf_backend.py                      # GPU: Qwen3-8B bf16; CPU: Qwen3-0.6B, a smaller load
    python benchmarks/hf_backend.py --model qwen3-8b --json out.json

Each implementation runs in its own process (one engine each, nothing shared): batch-1 decode (ms per token of one
16-token prompt, from the request's own first- and last-token times) and throughput of ``--prompts`` random-id
prompts of ``--input-len`` tokens, ``--output-len`` greedy tokens each (ignore_eos), one ``generate`` call
(GPU default: 512 x 1024 in / 512 out). (Dummy weights are drawn over each implementation's own parameters, so
the two do not compute the same tokens: the CPU tests compare outputs, this compares speed.) A table, then one JSON line
(benchmarks/common.py: report), also written to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import report

# This directory's kernels.py would shadow the `kernels` package transformers' modeling code imports.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

IMPLS = ("native", "transformers")


def _prompts(args) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(10, 5000) for _ in range(args.input_len)] for _ in range(args.prompts)]


def one_impl(args) -> dict:
    """Runs in a child process: one engine with ``--model-impl``, the batch-1 decode, the throughput load."""
    import torch

    from turnout import LLM, SamplingParams
    from turnout.entrypoints.bench_models import resolve_model

    t0 = time.perf_counter()
    llm = LLM(resolve_model(args.model)[0], load_format="dummy", dtype=args.dtype, device=args.device, seed=0,
              model_impl=args.one, max_model_len=args.input_len + args.output_len + 8,
              max_num_batched_tokens=args.max_num_batched_tokens,
              **({"kv_cache_memory": 1 << 30} if args.device == "cpu" else {}))
    start_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if torch.cuda.is_available() and args.device != "cpu" else (lambda: None)
    prompts = _prompts(args)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm
    one = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    sync()
    o = llm.generate([prompts[1][:16]], one, use_tqdm=False)[0]
    m = o.metrics
    decode_ms = (m.last_token_time - m.first_token_time) / max(len(o.outputs[0].token_ids) - 1, 1) * 1e3
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    out_tokens = sum(len(x.outputs[0].token_ids) for x in outs)
    model = llm.engine.runner.model
    return {"model_impl": args.one, "class": type(model).__name__, "start_s": start_s, "seconds": dt,
            "output_tok_s": out_tokens / dt, "total_tok_s": (out_tokens + sum(map(len, prompts))) / dt,
            "decode_ms_per_token_b1": decode_ms, "decode_tok_s_b1": 1e3 / decode_ms,
            "plan": model.plan.describe()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default=None, help="a name in benchmarks/configs or a path (default by device)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", choices=IMPLS, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device != "cpu"
    defaults = dict(model="qwen3-8b", dtype="bfloat16", prompts=512, input_len=1024, output_len=512,
                    decode_tokens=129, max_num_batched_tokens=8192) if gpu else \
        dict(model="qwen3-0.6b", dtype="float32", prompts=4, input_len=32, output_len=8, decode_tokens=9,
             max_num_batched_tokens=512)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.one:
        print("RESULT " + json.dumps(one_impl(args)))
        return 0
    rows = []
    for impl in IMPLS:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", impl] + [
            f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("device", *defaults)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            return 1
        rows.append(json.loads(line[len("RESULT "):]))
    native, hf = rows
    extra = {"device": args.device, "model": args.model, "dtype": args.dtype,
             "load": {k: getattr(args, k) for k in defaults},
             "transformers_vs_native_output_tok_s": hf["output_tok_s"] / native["output_tok_s"],
             "transformers_vs_native_decode_tok_s_b1": hf["decode_tok_s_b1"] / native["decode_tok_s_b1"]}
    report(f"transformers backend vs native, {args.model} {args.dtype} on {args.device}", rows,
           ["model_impl", "class", "output_tok_s", "total_tok_s", "seconds", "decode_ms_per_token_b1",
            "decode_tok_s_b1", "start_s"], extra)
    print(f"transformers / native: throughput {extra['transformers_vs_native_output_tok_s']:.3f}, batch-1 decode "
          f"{extra['transformers_vs_native_decode_tok_s_b1']:.3f} (target >= 0.90)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, **extra}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
