"""moe_experts on one GPU: every available implementation (plus torch._grouped_mm, registered or not, and
the two Triton paths forced) on the expert shapes of a config (default Qwen3-30B-A3B: H 2048, I 768, 128
experts, top-8), from decode to prefill batch sizes.

Bytes counted are the bytes a step must read: the weights of the experts that got at least one token
(w13 + w2) plus the hidden states in and out. Each measurement cycles through ROUTINGS different routings
(and inputs) so that, as in a model whose 48 layers each have their own experts, the weights do not sit
in L2 between calls. Times come from a CUDA graph of those calls (what decode runs), with the eager time
(host launch overhead included) next to it. GB/s and TFLOP/s are shown with their ratio to a device copy
(bytes read + written) and a large GEMM measured in the same run. A table, then one JSON line.

    python benchmarks/moe_experts.py [--config benchmarks/configs/qwen3_30b_a3b.json] [--tokens 1,8,64,512,4096]
                                     [--sweep]   # also a few decode tile configs at T <= 64 (tuning)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, gemm_tflops, machine, report  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROUTINGS = 8
TARGET_S = 0.04  # measured time per (implementation, T): enough replays to fill about this


def _replays(run_once, budget_s: float) -> float:
    """Seconds per run_once(), timed with CUDA events over as many repetitions as fit the budget."""
    run_once()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run_once()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-6)
    reps = max(2, min(200, int(budget_s / once)))
    start.record()
    for _ in range(reps):
        run_once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def measure(fn, inputs, w13, w2) -> tuple[float | None, float, str]:
    """(graph seconds per call or None if capture failed, eager seconds per call, note)."""
    def eager():
        for x, w, ids in inputs:
            fn(x, w13, w2, w, ids)

    eager()  # compile / warm up every shape
    torch.cuda.synchronize()
    eager_s = _replays(eager, TARGET_S / 2) / len(inputs)
    note = ""
    graph_s = None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        graph_s = _replays(graph.replay, TARGET_S) / len(inputs)
        del graph
    except Exception as ex:  # noqa: BLE001 - an implementation that cannot be captured is still timed
        torch.cuda.synchronize()
        note = f"no graph: {type(ex).__name__}: {ex}"[:60]
    return graph_s, eager_s, note


def implementations(platform, tokens: int, k: int, e: int):
    from turnout.ops import Policy, build_registry
    from turnout.ops.resolution import resolve_op
    from turnout.ops.triton import moe as triton_moe
    from turnout.ops.triton.moe_decode import moe_experts_decode
    from turnout.ops.triton.moe_decode_config import use_decode

    res = resolve_op("moe_experts", build_registry(), platform, Policy())
    impls = {c.impl: c.fn for c in res.candidates if c.available and c.impl != "reference.torch"}
    if "triton.default" in impls:
        chosen = "decode" if use_decode(tokens, k, e) else "grouped"
        impls[f"triton.default ({chosen})"] = impls.pop("triton.default")
    if tokens * k <= 32 * e:  # the decode path forced where it is still sane (it handles any T)
        impls["triton decode (forced)"] = moe_experts_decode
    impls["triton grouped (forced)"] = triton_moe.moe_experts_grouped
    if "vendor.cuda" not in impls:
        from turnout.ops.vendors.cuda import moe as vendor_moe

        ok, why = vendor_moe.check(platform)
        try:
            if ok:
                impls["grouped_mm (unregistered)"] = vendor_moe.load()
        except Exception as ex:  # noqa: BLE001
            ok, why = False, str(ex)
        if not ok and tokens == 1:
            print(f"torch._grouped_mm skipped: {why}")
    return impls


def sweep_configs():
    """Decode tile configs: the down kernel's grid first (gate/up at its default), then gate/up's."""
    from turnout.ops.triton.moe_decode_config import DEFAULT_CONFIG, DecodeConfig

    out = {}
    for bn in (32, 64, 128):
        for bk in (64, 128, 256):
            for st in (3, 4):
                for w in (4, 8):
                    if bn * bk > 128 * 128 and w == 4:
                        continue
                    out[f"down bn{bn} bk{bk} s{st} w{w}"] = DecodeConfig(
                        block_n2=bn, block_k2=bk, block_n2_many=bn, block_k2_many=bk, num_stages2=st, num_warps2=w,
                        num_warps=DEFAULT_CONFIG.num_warps)
    for bn in (16, 32, 64):
        for bk in (64, 128, 256):
            for st in (3, 4, 5):
                if bn * bk > 64 * 128 and st == 5:
                    continue
                out[f"gate_up bn{bn} bk{bk} s{st}"] = DecodeConfig(block_n1=bn, block_k1=bk, num_stages=st,
                                                                   num_stages2=DEFAULT_CONFIG.num_stages)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "qwen3_30b_a3b.json"))
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sweep", action="store_true", help="also time a few decode tile configs at T <= 64")
    args = ap.parse_args()
    from turnout.layers.moe.router import RoutingConfig, select_experts
    from turnout.platforms.detect import detect_platform

    wall = time.perf_counter()
    platform = detect_platform("cuda")
    cfg = json.load(open(args.config))
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    e, k = cfg.get("num_experts") or cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dtype, generator=gen) * h ** -0.5  # [E, 2I, H]
    w2 = torch.randn(e, h, inter, device=dev, dtype=dtype, generator=gen) * inter ** -0.5  # [E, H, I]
    elem = w13.element_size()
    ceil_bw, ceil_tf = copy_bandwidth(dev, 2 << 30), gemm_tflops(dev, dtype, 8192)
    routing = RoutingConfig(num_experts=e, top_k=k, renormalize=True)
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        inputs = []
        for _ in range(ROUTINGS):
            x = torch.randn(t, h, device=dev, dtype=dtype, generator=gen)  # [T, H]
            weights, ids = select_experts(torch.randn(t, e, device=dev, generator=gen), routing)
            inputs.append((x, weights, ids))
        touched = sum(torch.unique(ids).numel() for _, _, ids in inputs) / ROUTINGS  # mean experts read
        flops = 6 * t * k * h * inter
        nbytes = touched * 3 * h * inter * elem + 2 * t * h * elem
        impls = implementations(platform, t, k, e)
        if args.sweep and t <= 64:
            from turnout.ops.triton.moe_decode import moe_experts_decode

            for label, dcfg in sweep_configs().items():
                impls[f"decode {label}"] = (lambda c: lambda *a: moe_experts_decode(*a, config=c))(dcfg)
        for name, fn in impls.items():
            try:
                graph_s, eager_s, note = measure(fn, inputs, w13, w2)
            except Exception as ex:  # noqa: BLE001
                torch.cuda.synchronize()
                rows.append({"impl": name, "tokens": t, "error": f"{type(ex).__name__}: {ex}"[:80]})
                continue
            s = graph_s if graph_s is not None else eager_s
            rows.append({"impl": name, "tokens": t, "experts_read": round(touched, 1), "MB_read": nbytes / 1e6,
                         "us": s * 1e6, "us_eager": eager_s * 1e6, "GB_s": nbytes / s / 1e9,
                         "pct_copy": 100 * nbytes / s / 1e9 / ceil_bw, "TFLOP_s": flops / s / 1e12,
                         "pct_gemm": 100 * flops / s / 1e12 / ceil_tf, "error": note or None})
        del inputs
    report(f"moe_experts {os.path.basename(args.config)} H{h} I{inter} E{e} k{k} {args.dtype} "
           f"(us: CUDA graph of {ROUTINGS} routings; us_eager: launched from Python)", rows,
           ["impl", "tokens", "experts_read", "MB_read", "us", "us_eager", "GB_s", "pct_copy", "TFLOP_s",
            "pct_gemm", "error"],
           {"machine": machine(), "ceilings": {"copy_GB_s": ceil_bw, "gemm_TFLOP_s": ceil_tf},
            "wall_s": time.perf_counter() - wall})


if __name__ == "__main__":
    main()
