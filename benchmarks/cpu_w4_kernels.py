"""w4a16_linear on the CPU, per projection: vendor.cpu_native (turnout's C++ kernel) against vendor.cpu (slabs
dequantised by torch calls) and against the float32 GEMM of the dequantised weight (``F.linear``, what a model
dequantised at load runs), with the machine's copy bandwidth and float32 GEMM rate measured in the same run.

Each shape cycles through --weights distinct weights (more bytes than the last-level cache: the weight comes from
memory, as in a model's step). Shapes: SmolLM2-135M's projections (qkv fused, o, gate/up fused, down). Prints a
table and one ``JSON`` line.

    PYTHONPATH=$PWD python benchmarks/cpu_w4_kernels.py [--rows 1,2,4,8,32,128,512] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _time(fn, items, reps: int) -> float:
    for it in items:
        fn(it)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for it in items:
            fn(it)
        best = min(best, (time.perf_counter() - t0) / len(items))
    return best * 1e6


def ceilings() -> dict:
    a = torch.empty(64 << 20)  # 256 MB
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    copy_gbs = 2 * a.numel() * 4 * 5 / (time.perf_counter() - t0) / 1e9  # read + write
    x, w = torch.randn(512, 1024), torch.randn(1024, 1024)
    x @ w
    t0 = time.perf_counter()
    for _ in range(10):
        x @ w
    gemm = 2 * 512 * 1024 * 1024 * 10 / (time.perf_counter() - t0) / 1e9
    return {"copy_GBps": round(copy_gbs, 1), "gemm_fp32_GFLOPs": round(gemm, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,32,128,512")
    ap.add_argument("--weights", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from turnout.ops.reference.w4a16 import dequantize_w4, random_w4
    from turnout.ops.vendors.cpu import native
    from turnout.ops.vendors.cpu.w4a16 import w4a16_linear as slab

    fast = native.w4a16_linear_factory()
    gen = torch.Generator().manual_seed(0)
    out = {"threads": torch.get_num_threads(), "machine": os.uname().machine,
           **ceilings(), "rows": []}
    for name, (n, k) in SHAPES.items():
        ws = [random_w4(n, k, 32, torch.float32, "cpu", gen) for _ in range(args.weights)]
        dense = [dequantize_w4(q, s, 32) for q, s in ws]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen)
            idx = range(args.weights)
            t_native = _time(lambda i: fast(x, *ws[i], 32), idx, args.reps)
            t_slab = _time(lambda i: slab(x, *ws[i], 32), idx, args.reps)
            t_f32 = _time(lambda i: F.linear(x, dense[i]), idx, args.reps)
            w4_bytes = n * k // 2 + (k // 32) * n * 2 * 4
            out["rows"].append({"proj": name, "N": n, "K": k, "M": m, "native_us": round(t_native, 1),
                                "slab_us": round(t_slab, 1), "float32_us": round(t_f32, 1),
                                "native_vs_float32": round(t_f32 / t_native, 2),
                                "native_GBps_of_w4": round(w4_bytes / t_native / 1e3, 1),
                                "native_GFLOPs": round(2 * m * n * k / t_native / 1e3, 1)})
    print(f"threads {out['threads']}, copy {out['copy_GBps']} GB/s (read + write), float32 GEMM "
          f"{out['gemm_fp32_GFLOPs']} GFLOP/s")
    cols = ["proj", "N", "K", "M", "native_us", "slab_us", "float32_us", "native_vs_float32", "native_GBps_of_w4",
            "native_GFLOPs"]
    print(" | ".join(cols))
    for r in out["rows"]:
        print(" | ".join(str(r[c]) for c in cols))
    print("JSON " + json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
