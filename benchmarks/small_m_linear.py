"""small_m_linear against the vendor BLAS (torch F.linear: cuBLAS / hipBLASLt) on decode-shaped projections.

For each weight shape of the configs given (qkv, o, router, dense MLP, LM head) and each row count M,
both are timed in a CUDA graph that cycles through enough distinct weights (> 256 MB) that nothing stays
in L2, as in a model whose layers each have their own weights. Bytes counted: the weight plus x and y.
Ratios are to a device copy measured in the same run. A table, then one JSON line.

    python benchmarks/small_m_linear.py [--configs benchmarks/configs/qwen3_30b_a3b.json,...] [--m 1,2,4,8,16]
                                        [--sweep]   # also the tile configs, at the M values of --sweep-m
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, machine, report  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CYCLE_BYTES = 256 << 20


def shapes_of(path: str) -> dict[str, tuple[int, int]]:
    name = os.path.basename(path.rstrip("/")).removesuffix(".json")
    cfg = json.load(open(os.path.join(path, "config.json") if os.path.isdir(path) else path))
    h = cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    out = {f"{name} qkv": ((heads + 2 * kv) * d, h), f"{name} o": (h, heads * d)}
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts")
    if experts:
        out[f"{name} router"] = (experts, h)
    else:
        out[f"{name} gate_up"] = (2 * cfg["intermediate_size"], h)
        out[f"{name} down"] = (h, cfg["intermediate_size"])
    out[f"{name} lm_head"] = (cfg["vocab_size"], h)
    return out


def time_graph(fn, args_list) -> float:
    """Seconds per call of fn over args_list, replayed from one CUDA graph."""
    for a in args_list:
        fn(*a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in args_list:
            fn(*a)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / 1e3 / reps / len(args_list)


def sweep_configs():
    from turnout.ops.triton.linear import SmallMConfig

    out = {}
    for bn in (8, 16, 32, 64):
        for bk in (128, 256, 512):
            for w in (4, 8):
                for st in (3, 5):
                    if bn * bk > 64 * 256 or (bn * bk <= 16 * 128 and w == 8):
                        continue
                    out[f"bn{bn} bk{bk} w{w} s{st}"] = SmallMConfig(bn, bk, w, st)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(os.path.join(HERE, "configs", c) for c in
                                                  ("qwen3_30b_a3b.json", "qwen3-8b")))
    ap.add_argument("--m", default="1,2,4,8,16")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-m", default="1,16")
    args = ap.parse_args()
    from turnout.ops.triton.linear import small_m_linear

    wall = time.perf_counter()
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    ceil_bw = copy_bandwidth(dev, 2 << 30)
    shapes = {}
    for path in args.configs.split(","):
        shapes.update(shapes_of(path))
    sweep_m = {int(m) for m in args.sweep_m.split(",")}
    rows = []
    for label, (n, k) in shapes.items():
        elem = torch.finfo(dtype).bits // 8
        copies = min(128, max(2, -(-CYCLE_BYTES // (n * k * elem))))
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5 for _ in range(copies)]
        for m in [int(x) for x in args.m.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            arg_list = [(x, w) for w in weights]
            nbytes = (n * k + m * k + m * n) * elem
            impls = {"cublas (F.linear)": F.linear, "small_m_linear": small_m_linear}
            if args.sweep and m in sweep_m:
                for name, cfg in sweep_configs().items():
                    impls[f"small_m {name}"] = (lambda c: lambda a, w: small_m_linear(a, w, config=c))(cfg)
            ref = F.linear(x, weights[0]).float()
            best = None
            for name, fn in impls.items():
                try:
                    err = (fn(x, weights[0]).float() - ref).abs().max().item()
                    s = time_graph(fn, arg_list)
                except Exception as ex:  # noqa: BLE001
                    torch.cuda.synchronize()
                    rows.append({"shape": label, "M": m, "impl": name, "error": f"{type(ex).__name__}: {ex}"[:80]})
                    continue
                row = {"shape": label, "N": n, "K": k, "M": m, "impl": name, "MB": nbytes / 1e6, "us": s * 1e6,
                       "GB_s": nbytes / s / 1e9, "pct_copy": 100 * nbytes / s / 1e9 / ceil_bw, "max_err": err}
                if name.startswith("small_m "):  # a sweep entry: keep only the best
                    if best is None or row["us"] < best["us"]:
                        best = row
                else:
                    rows.append(row)
            if best is not None:
                rows.append({**best, "impl": "best " + best["impl"]})
        del weights
    report(f"small_m_linear vs vendor BLAS, {args.dtype} (CUDA graph cycling > 256 MB of weights)", rows,
           ["shape", "M", "impl", "MB", "us", "GB_s", "pct_copy", "max_err", "error"],
           {"machine": machine(), "ceilings": {"copy_GB_s": ceil_bw}, "wall_s": time.perf_counter() - wall})


if __name__ == "__main__":
    main()
