"""The MLA decode kernel alone at DeepSeek-V3's attention shape, against the copy bandwidth measured in the same run.

One decode step of ``batch`` sequences of ``context`` tokens: 128 query heads, latent 512 + rope 64 per token
(``kv_lora_rank``, ``qk_rope_head_dim``), block 16, bf16 queries, over a bf16 latent cache and an fp8 one. Timed:
the op table's ``mla_paged_attention`` (Triton) as one launch inside a CUDA graph of 10 (no launch gaps). Reported:
ms, the latent-cache bytes the step reads, their rate (GB/s), and that rate against the device's copy bandwidth
measured here (``copy_read_GB_s``: bytes read per second by a large device copy, i.e. half its read + write
rate), the ratio the issue's 80 % target is about. ``--sweep`` also times each tile of SWEEP and split counts.

On CPU (``--device cpu``, for CI) the same runs at a tiny shape under the Triton interpreter (perf_counter),
to check the script works; its numbers mean nothing.

Usage: python benchmarks/mla_decode.py [--shapes 64x4096,256x1024] [--sweep] [--out DIR] [--device cuda]
Writes mla_decode.json in --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

HEADS, LATENT, ROPE, BLOCK = 128, 512, 64, 16
SWEEP = [{"block_h": h, "block_n": n, "num_warps": w, "num_stages": s}
         for h in (16, 32) for n in (16, 32, 64) for w in (4, 8) for s in (1, 2, 3)]
SPLITS = (1, 2, 4, 8)


def _time(fn, device: str) -> float:
    """Milliseconds a call: a CUDA graph of 10 calls replayed 20 times; on CPU the median of 3 calls."""
    if device != "cuda":
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[1] * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    del graph
    return a.elapsed_time(b) / 200


def case(ops, batch: int, context: int, heads: int, latent: int, rope: int, fp8: bool, device: str,
         copy_read: float, sweep: bool) -> dict:
    from turnout.ops.kv_cache import FP8_KV
    from turnout.ops.reference.cache import to_cache

    dev = torch.device(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    nblk = math.ceil(context / BLOCK)
    g = torch.Generator(device="cpu").manual_seed(0)
    tables = torch.randperm(batch * nblk, generator=g).view(batch, nblk).to(dev, torch.int32)  # scattered blocks
    cache = torch.randn(batch * nblk, BLOCK, latent + rope, dtype=dtype, device=dev)
    kw = {}
    if fp8:
        scale = torch.tensor([0.02], device=dev)
        cache, kw = to_cache(cache, FP8_KV, scale), {"kv_scale": scale}
    q_lat = torch.randn(batch, heads, latent, dtype=dtype, device=dev) * latent ** -0.5
    q_pe = torch.randn(batch, heads, rope, dtype=dtype, device=dev)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    args = (q_lat, q_pe, cache, tables, lens, qsl, 1, context, (192 ** -0.5))
    nbytes = batch * context * (latent + rope) * cache.element_size()

    def run(fn):
        ms = _time(lambda: fn(*args, **kw), device)
        rate = nbytes / ms / 1e6
        return {"ms": ms, "GB_s": rate, "of_copy": rate / copy_read}

    out = {"batch": batch, "context": context, "cache": "fp8" if fp8 else str(dtype).replace("torch.", ""),
           "impl": ops.chosen("mla_paged_attention"), "cache_bytes": nbytes, **run(ops.mla_paged_attention)}
    if sweep:
        from turnout.ops.triton import mla

        rows = []
        for tiles in SWEEP:
            for splits in SPLITS:
                try:
                    r = run(lambda *a, **k: mla.mla_paged_attention(*a, **k, num_splits=splits, tiles=tiles))
                except Exception as e:  # a tile that does not fit (shared memory, registers) is skipped, and said
                    rows.append({**tiles, "num_splits": splits, "error": str(e).splitlines()[0][:200]})
                    continue
                rows.append({**tiles, "num_splits": splits, **r})
        ok = [r for r in rows if "ms" in r]
        out["sweep"] = rows
        out["best"] = min(ok, key=lambda r: r["ms"]) if ok else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="64x4096,256x1024", help="batch x context, comma-separated")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sweep", action="store_true", help="also every tile of SWEEP x split count of SPLITS")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from turnout.ops import Policy, resolve
    from turnout.platforms import detect_platform
    from turnout.utils.roofline import copy_bandwidth

    device = args.device
    if device == "cpu":  # the interpreter at a tiny shape: the script's plumbing, not a measurement
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from turnout import envs

        envs.reload()
        heads, latent, rope, shapes = 4, 32, 16, [(2, 64)]
    else:
        heads, latent, rope = HEADS, LATENT, ROPE
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    platform = detect_platform(device)
    copy_rw = copy_bandwidth(device, (2 << 30) if device == "cuda" else (1 << 24), 10 if device == "cuda" else 2)
    copy_read = copy_rw / 2
    rows = []
    for fp8 in (False, True):
        policy = "mla_paged_attention=triton.default" + (";kv_cache=fp8" if fp8 else "")
        ops = resolve(platform, Policy.parse(policy, source="bench"), ops=["mla_paged_attention"])
        for batch, context in shapes:
            rows.append(case(ops, batch, context, heads, latent, rope, fp8, device, copy_read, args.sweep))
            if device == "cuda":
                torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
              "shape": {"heads": heads, "latent": latent, "rope": rope, "block": BLOCK},
              "copy_read_GB_s": copy_read, "copy_rw_GB_s": copy_rw, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mla_decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['device']}: copy {copy_read:.0f} GB/s read ({copy_rw:.0f} read + write)")
    print(f"{'batch x ctx':>12} {'cache':>6} {'ms':>8} {'GB/s':>8} {'of copy':>8}  best tile")
    for r in rows:
        best = r.get("best")
        tile = "" if not best else (f"{best['ms']:.3f} ms {best['of_copy']:.0%}: h{best['block_h']} n{best['block_n']} "
                                    f"w{best['num_warps']} s{best['num_stages']} splits {best['num_splits']}")
        print(f"{r['batch']:>5} x {r['context']:<5} {r['cache']:>6} {r['ms']:>8.3f} {r['GB_s']:>8.0f} "
              f"{r['of_copy']:>8.0%}  {tile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
