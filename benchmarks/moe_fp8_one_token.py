"""The one-token fp8 MoE path (``moe_experts_fp8_decode`` at T = 1, turnout/ops/triton/moe_fp8_decode.py) under
several ``Fp8DecodeConfig`` tiles, on Qwen3-30B-A3B's experts (128 x 128 block scales), against the bf16
``moe_experts`` on the same routings. Each timed from one CUDA graph of 16 calls with different routings (so the
8 experts of a call are rarely in L2), the bytes moved counted from the experts hit. Prints a table and one JSON
line; ``--json`` writes it.

    PYTHONPATH=$PWD python benchmarks/moe_fp8_one_token.py [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    from fp8 import moe_experts_weights
    from small_m_linear import time_graph

    from turnout.ops.triton.moe import moe_experts
    from turnout.ops.triton.moe_fp8_decode import DEFAULT, moe_experts_fp8_decode

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    (h, inter, k, e), w13, w2, q13, s13, q2, s2 = moe_experts_weights("qwen3_30b_a3b")
    dev = w13.device
    calls = [(torch.randn(1, h, device=dev, dtype=torch.bfloat16), torch.randperm(e, device=dev)[:k][None].int(),
              torch.rand(1, k, device=dev)) for _ in range(16)]
    fp8_bytes = k * 3 * inter * h  # per call: k experts' w13 + w2, one byte a weight
    bf16 = time_graph(lambda x, ids, wt: moe_experts(x, w13, w2, wt, ids), calls)
    result = {"bf16_us": bf16 * 1e6, "bf16_GB_s": 2 * fp8_bytes / bf16 / 1e9, "configs": {}}
    print(f"bf16 moe_experts: {bf16 * 1e6:.1f} us ({2 * fp8_bytes / bf16 / 1e9:.0f} GB/s)", flush=True)
    grid = [dict(block_n_one_up=bn, block_k_one_up=bk, num_warps_one_up=w)
            for bn, bk, w in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8)) if bn * bk <= 16384]
    grid += [dict(block_n_one=bn, block_k_one=1024, num_warps_one=w) for bn, w in itertools.product((4, 8, 16),
                                                                                                      (4, 8))]
    for fields in [{}] + grid:
        c = dataclasses.replace(DEFAULT, **fields)
        try:
            t = time_graph(lambda x, ids, wt: moe_experts_fp8_decode(x, q13, s13, q2, s2, wt, ids, config=c), calls)
        except Exception as ex:  # noqa: BLE001 - a tile the compiler rejects
            print(f"{fields}: {type(ex).__name__}", flush=True)
            continue
        key = json.dumps(fields) if fields else "default"
        result["configs"][key] = {"us": t * 1e6, "GB_s": fp8_bytes / t / 1e9}
        print(f"fp8 {key}: {t * 1e6:.1f} us ({fp8_bytes / t / 1e9:.0f} GB/s)", flush=True)
    best = min(result["configs"], key=lambda key: result["configs"][key]["us"])
    result["best"] = best
    print(f"best: {best} {result['configs'][best]['us']:.1f} us")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
