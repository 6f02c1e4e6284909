"""Batch-invariant mode against the default (the target: at most 20 % slower), dummy weights.

    python benchmarks/batch_invariant.py                      # GPU: Qwen3-8B bf16; CPU: Qwen3-0.6B, smaller load
    python benchmarks/batch_invariant.py --model qwen3_30b_a3b --json out.json

Each mode runs in its own process (one engine each, nothing shared): the same load of ``--prompts`` random-id
prompts (lengths spread over ``--min-len``..``--max-len``), greedy, ``--max-tokens`` each (ignore_eos), one
``generate`` call. Reported per mode: output tok/s, total (prompt + output) tok/s, seconds, and the batch-1
decode ms per token of one prompt alone; then whether prompt 0's tokens and logprobs alone equal those it
gets inside the load (the mode's promise: True in batch-invariant mode; the default is usually False).
A table, then one JSON line (benchmarks/common.py: report), also written to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import report


def _load(args) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(10, 5000) for _ in range(rng.randint(args.min_len, args.max_len))]
            for _ in range(args.prompts)]


def _lps(comp):
    return [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]


def one_mode(args) -> dict:
    """Runs in a child process: one engine, the load, the batch-1 decode, the invariance check."""
    import torch

    from turnout import LLM, SamplingParams
    from turnout.entrypoints.bench_models import resolve_model

    inv = args.one == "invariant"
    t0 = time.perf_counter()
    llm = LLM(resolve_model(args.model)[0], load_format="dummy", dtype=args.dtype, device=args.device, seed=0,
              max_model_len=args.max_len + args.max_tokens + 8, batch_invariant=inv,
              max_num_batched_tokens=args.max_num_batched_tokens, **({"kv_cache_memory": 1 << 30}
                                                                     if args.device == "cpu" else {}))
    start_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if torch.cuda.is_available() and args.device != "cpu" else (lambda: None)
    prompts = _load(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm
    alone = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0]
    one = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    sync()
    # decode time per token from the request's own first- and last-token times (a separate prefill-only run
    # to subtract would be a prefix-cache miss while this one hits, which biased the figure low)
    o = llm.generate([prompts[1][:16]], one, use_tqdm=False)[0]
    m = o.metrics
    decode_ms = (m.last_token_time - m.first_token_time) / max(len(o.outputs[0].token_ids) - 1, 1) * 1e3
    llm.reset_prefix_cache()
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    batched = outs[0].outputs[0]
    return {"mode": "batch_invariant" if inv else "default", "start_s": start_s, "seconds": dt,
            "output_tok_s": out_tokens / dt, "total_tok_s": (out_tokens + in_tokens) / dt,
            "decode_ms_per_token_b1": decode_ms,
            "prompt0_tokens_same": batched.token_ids == alone.token_ids,
            "prompt0_logprobs_bitwise_same": _lps(batched) == _lps(alone),
            "ops": llm.engine.ops.policy.describe(), "plan": llm.engine.runner.model.plan.describe()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default=None, help="a name in benchmarks/configs or a path (default by device)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--min-len", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", choices=["default", "invariant"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device != "cpu"
    defaults = dict(model="qwen3-8b", dtype="bfloat16", prompts=256, min_len=128, max_len=1024, max_tokens=256,
                    decode_tokens=129, max_num_batched_tokens=8192) if gpu else \
        dict(model="qwen3-0.6b", dtype="float32", prompts=8, min_len=16, max_len=64, max_tokens=16, decode_tokens=9,
             max_num_batched_tokens=512)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.one:
        print("RESULT " + json.dumps(one_mode(args)))
        return 0
    rows = []
    for mode in ("default", "invariant"):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", mode] + [
            f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("device", *defaults)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            return 1
        rows.append(json.loads(line[len("RESULT "):]))
    base, inv = rows
    extra = {"device": args.device, "model": args.model, "dtype": args.dtype, "load": {k: getattr(args, k) for k in defaults},
             "invariant_vs_default_output_tok_s": inv["output_tok_s"] / base["output_tok_s"],
             "invariant_vs_default_decode_ms": inv["decode_ms_per_token_b1"] / base["decode_ms_per_token_b1"]}
    report(f"batch-invariant vs default, {args.model} {args.dtype} on {args.device}", rows,
           ["mode", "output_tok_s", "total_tok_s", "seconds", "decode_ms_per_token_b1", "prompt0_tokens_same",
            "prompt0_logprobs_bitwise_same", "start_s"], extra)
    print(f"invariant / default: throughput {extra['invariant_vs_default_output_tok_s']:.3f}, "
          f"batch-1 decode time {extra['invariant_vs_default_decode_ms']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, **extra}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
