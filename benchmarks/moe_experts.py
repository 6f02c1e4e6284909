"""moe_experts on one GPU: every available implementation (plus torch._grouped_mm, registered or not) on
the expert shapes of a config (default Qwen3-30B-A3B: H 2048, I 768, 128 experts, top-8), from decode to
prefill batch sizes. Prints time, achieved TFLOP/s and GB/s (touched expert weights + activations) and
their ratio to the GEMM / copy ceilings measured in the same run.

    python benchmarks/moe_experts.py [--config benchmarks/configs/qwen3_30b_a3b.json] [--tokens 1,8,64,512,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, gemm_tflops, machine, report  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def implementations(platform):
    from turnout.ops import Policy, build_registry
    from turnout.ops.dispatch import resolve_op

    res = resolve_op("moe_experts", build_registry(), platform, Policy())
    impls = {c.impl: c.fn for c in res.candidates if c.available and c.impl != "reference.torch"}
    if "vendor.cuda" not in impls:
        from turnout.ops.vendors.cuda import moe as vendor_moe

        ok, why = vendor_moe.check(platform)
        try:
            impls["grouped_mm (unregistered)"] = vendor_moe.load() if ok else None
        except Exception as e:  # noqa: BLE001
            why = str(e)
        if not ok or impls.get("grouped_mm (unregistered)") is None:
            impls.pop("grouped_mm (unregistered)", None)
            print(f"torch._grouped_mm skipped: {why}")
    return impls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "qwen3_30b_a3b.json"))
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    from turnout.layers.moe.router import RoutingConfig, select_experts
    from turnout.platforms.detect import detect_platform

    platform = detect_platform("cuda")
    cfg = json.load(open(args.config))
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    e, k = cfg.get("num_experts") or cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dtype) * h ** -0.5
    w2 = torch.randn(e, h, inter, device=dev, dtype=dtype) * inter ** -0.5
    elem = w13.element_size()
    ceil_bw, ceil_tf = copy_bandwidth(dev, 2 << 30), gemm_tflops(dev, dtype, 8192)
    impls = implementations(platform)
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        x = torch.randn(t, h, device=dev, dtype=dtype)
        weights, ids = select_experts(torch.randn(t, e, device=dev), RoutingConfig(num_experts=e, top_k=k))
        touched = torch.unique(ids).numel()
        flops = 6 * t * k * h * inter
        nbytes = touched * 3 * h * inter * elem + 2 * t * h * elem
        for name, fn in impls.items():
            try:
                s = timed(lambda: fn(x, w13, w2, weights, ids), args.iters)
            except Exception as ex:  # noqa: BLE001
                rows.append({"impl": name, "tokens": t, "error": f"{type(ex).__name__}: {ex}"[:80]})
                continue
            rows.append({"impl": name, "tokens": t, "experts_touched": touched, "us": s * 1e6,
                         "TFLOP_s": flops / s / 1e12, "GB_s": nbytes / s / 1e9,
                         "pct_gemm": 100 * flops / s / 1e12 / ceil_tf, "pct_copy": 100 * nbytes / s / 1e9 / ceil_bw})
    report(f"moe_experts {os.path.basename(args.config)} H{h} I{inter} E{e} k{k} {args.dtype}", rows,
           ["impl", "tokens", "experts_touched", "us", "TFLOP_s", "GB_s", "pct_gemm", "pct_copy", "error"],
           {"machine": machine(), "ceilings": {"copy_GB_s": ceil_bw, "gemm_TFLOP_s": ceil_tf}})


if __name__ == "__main__":
    main()
