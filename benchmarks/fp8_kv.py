"""fp8 KV cache on the GPU: tokens held, and decode attention bandwidth at batch 64 x 4096.

Part 1, the kernel alone: the op table's ``paged_attention`` (Triton) at one decode step of ``--batch``
sequences of ``--context`` tokens, Qwen3-8B's attention geometry (32 query heads, 8 KV heads, head dim 128),
over a bf16 cache and over an fp8 cache (per-tensor scales; V read as 16-bit pairs of columns, and byte-wise
as before: ``fp8_bytewise``). Reported: the time a launch from 20 replays of a CUDA graph
of 10 launches, the cache bytes a step reads and their rate (GB/s), beside a device copy of the same bytes.

Part 2, tokens held: ``LLM(model, load_format="dummy")`` with kv_cache_dtype auto and fp8, each in its own process
(one engine per process: the memory profile sees only its own), KV blocks, tokens, the default max_num_seqs.

Then, for the throughput at the new default max_num_seqs (512 x 1024 in / 512 out), run:

    turnout bench throughput --model Qwen/Qwen3-8B --load-format dummy --num-prompts 512 --input-len 1024 \\
        --output-len 512 [--kv-cache-dtype fp8]

Usage: python benchmarks/fp8_kv.py [--model Qwen/Qwen3-8B] [--batch 64] [--context 4096] [--out DIR]
Writes fp8_kv.json in --out (default: the current directory).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import torch


def _time(fn, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs (after 3 warm-ups), by CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _time_graph(fn, launches: int = 10) -> float:
    """Milliseconds a launch, from a CUDA graph of ``launches`` calls (benchmarks/small_m_linear.py's time_graph: no
    launch gaps; single launches timed by events spread +-20 % here)."""
    from small_m_linear import time_graph

    return time_graph(fn, [()] * launches) * 1e3


def _set_tuning(tuning: dict | None) -> None:
    """Decode attention's tiles for the next launches (TURNOUT_ATTN_DECODE, read at launch; None: built-in)."""
    from turnout import envs

    if tuning:
        os.environ["TURNOUT_ATTN_DECODE"] = json.dumps(tuning)
    else:
        os.environ.pop("TURNOUT_ATTN_DECODE", None)
    envs.reload()


SWEEP = [{"block_n": n, "num_warps": w, "num_stages": s, **({"num_splits": sp} if sp else {})}
         for n in (64, 128) for w in (2, 4, 8) for s in (2, 3, 4) for sp in (None, 2)
         if not (n == 128 and w == 2)]  # num_splits absent: the built-in choice


def kernel_part(batch: int, context: int, iters: int, hq=32, hk=8, d=128, bs=16, sweep: bool = False) -> dict:
    """The kernel at one decode step, bf16 and fp8 caches. ``sweep``: also each tile of SWEEP (built-in first)."""
    from turnout.ops import Policy, resolve
    from turnout.ops.kv_cache import FP8_KV
    from turnout.ops.reference.cache import to_cache
    from turnout.platforms import detect_platform

    platform = detect_platform("cuda")
    dev = torch.device("cuda")
    nblk = math.ceil(context / bs)
    tables = torch.arange(batch * nblk, dtype=torch.int32, device=dev).view(batch, nblk)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=dev)
    out = {"batch": batch, "context": context, "heads": [hq, hk, d]}
    from turnout.ops.triton import attention

    for name in ("bf16", "fp8", "fp8_bytewise"):  # fp8_bytewise: V read byte-wise (attention.V_PAIRS off)
        attention.V_PAIRS = name != "fp8_bytewise"
        policy = Policy.parse("" if name == "bf16" else "kv_cache=fp8", source="bench")
        ops = resolve(platform, policy, ops=["paged_attention"])
        k = torch.randn(batch * nblk, bs, hk, d, dtype=torch.bfloat16, device=dev)
        v = torch.randn_like(k)
        kw = {}
        if name != "bf16":
            ks, vs = (torch.tensor([0.02], device=dev) for _ in range(2))
            k, v = to_cache(k, FP8_KV, ks), to_cache(v, FP8_KV, vs)
            kw = {"k_scale": ks, "v_scale": vs}
        step = lambda: ops.paged_attention(q, k, v, tables, lens, qsl, 1, context, d ** -0.5, **kw)  # noqa: E731
        ms = _time_graph(step)
        nbytes = 2 * k.numel() * k.element_size()
        flat = k.view(torch.uint8).flatten()
        dst = torch.empty(2 * flat.numel(), dtype=torch.uint8, device=dev)
        copy_ms = _time(lambda: (dst[:flat.numel()].copy_(flat), dst[flat.numel():].copy_(flat)), iters)
        out[name] = {"impl": ops.chosen("paged_attention"), "ms": ms, "cache_bytes": nbytes,
                     "GB_s": nbytes / ms / 1e6, "copy_GB_s": 2 * nbytes / copy_ms / 1e6}
        if sweep and name == "fp8":  # the bf16 cache's tiles were swept before (docs/benchmarks.md)
            tiles = []
            for tuning in SWEEP:
                _set_tuning(tuning)
                try:
                    t_ms = _time_graph(step)
                except Exception as e:  # a tile that does not compile (shared memory) is skipped, and said
                    tiles.append({**tuning, "error": str(e).splitlines()[0][:200]})
                    continue
                tiles.append({**tuning, "ms": t_ms, "GB_s": nbytes / t_ms / 1e6})
            _set_tuning(None)
            ok = [t for t in tiles if "ms" in t]
            out[name]["sweep"] = tiles
            out[name]["best"] = min(ok, key=lambda t: t["ms"]) if ok else None
        k = v = dst = None  # free the memory now (not del: the closures above name them)
        torch.cuda.empty_cache()
    attention.V_PAIRS = True
    out["fp8_speedup"] = out["bf16"]["ms"] / out["fp8"]["ms"]
    return out


def tokens_held_child(model: str, kv: str) -> dict:
    from turnout import LLM

    llm = LLM(model, load_format="dummy", kv_cache_dtype=kv, max_model_len=1536)
    r = llm.engine.runner
    return {"kv_cache_dtype": kv, "blocks": r.num_blocks, "tokens": r.num_blocks * r.block_size,
            "GiB": r.num_blocks * r.block_bytes / 2**30, "max_num_seqs": llm.engine.config.max_num_seqs,
            "graph_buckets": len(r.graphs.buckets) if r.graphs is not None else 0,
            "graph_capture_s": r.graphs.capture_s if r.graphs is not None else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen/Qwen3-8B")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip-engines", action="store_true", help="only the kernel part")
    ap.add_argument("--sweep", action="store_true", help="also time each decode tile of SWEEP (TURNOUT_ATTN_DECODE)")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:  # part 2 in its own process
        print("RESULT " + json.dumps(tokens_held_child(args.model, args._child)), flush=True)
        return 0
    result = {"kernel": kernel_part(args.batch, args.context, args.iters, sweep=args.sweep)}
    print(json.dumps(result["kernel"], indent=1), flush=True)
    if args.sweep:  # a table: the tiles a cache reads fastest
        for name in ("bf16", "fp8", "fp8_bytewise"):
            r = result["kernel"][name]
            print(f"{name}: built-in {r['ms']:.3f} ms {r['GB_s']:.0f} GB/s (copy {r['copy_GB_s']:.0f})")
            for t in sorted((t for t in r.get("sweep", []) if "ms" in t), key=lambda t: t["ms"])[:6]:
                print(f"  block_n {t['block_n']:>3} warps {t['num_warps']} stages {t['num_stages']} "
                      f"splits {t.get('num_splits', 'auto')}: "
                      f"{t['ms']:.3f} ms {t['GB_s']:.0f} GB/s")
    if not args.skip_engines:
        held = []
        for kv in ("auto", "fp8"):
            proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--_child", kv],
                                  capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            held.append(json.loads(line[7:]) if line else {"kv_cache_dtype": kv, "error": proc.stderr[-2000:]})
            print(json.dumps(held[-1]), flush=True)
        result["tokens_held"] = held
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_kv.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
