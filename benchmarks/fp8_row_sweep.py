"""Tile sweep of the one-row fp8 decode kernel (``fp8_linear`` at M = 1) on a model's projections, each timed
from one CUDA graph of many launches (no launch overhead), against the built-in tiles and bf16
``small_m_linear`` on the same shapes. Prints a table, one JSON line, and the ``TURNOUT_SMALL_M_TILES`` value
that sets the fastest tiles (fp8_linear's one-row path honours it by "N,K").

    PYTHONPATH=$PWD python benchmarks/fp8_row_sweep.py [--model qwen3-8b] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    from small_m_linear import shapes_of, time_graph

    from turnout.ops.reference.fp8 import quantize_weight
    from turnout.ops.triton import fp8 as tfp8
    from turnout.ops.triton.linear import small_m_linear

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = args.model if os.path.exists(args.model) else os.path.join(HERE, "configs", args.model)
    configs = [(bn, bk, w, st) for bn, bk, w, st in itertools.product((1, 2, 4, 8, 16, 32), (512, 1024, 2048, 4096),
                                                                     (4, 8), (3,))
               if 2048 <= bn * bk <= 16384]  # 2-16 KiB of fp8 a tile: 30 configs a shape
    copies = 8  # distinct weights per graph, so L2 holds none of them between launches
    result, best_tiles = {}, {}
    for name, (n, k) in shapes_of(path).items():
        if name.endswith(("lm_head", "router")):  # stay in the compute dtype under fp8
            continue
        ws = [quantize_weight(torch.randn(n, k, device="cuda") * 0.02, "row") for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k

        def run(tiles=None):
            def fn(w, s):
                return tfp8.fp8_linear(x, w, s, tiles=None if tiles is None else {(n, k): tiles})
            return time_graph(fn, ws)

        default = run()
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        bf16 = time_graph(lambda w: small_m_linear(x, w, None), [(w,) for w in wb])
        wb = None  # free the memory now (not del: the closures above name them)
        times = {}
        for c in configs:
            if c[1] > max(128, 1 << (k - 1).bit_length()):
                continue
            try:
                times[c] = run(c)
            except Exception as e:  # noqa: BLE001 - a tile the compiler rejects (registers, shared memory)
                print(f"{name} {c}: {type(e).__name__}", flush=True)
        best = min(times, key=times.get)
        best_tiles[f"{n},{k}"] = list(best)
        result[name] = {"N": n, "K": k, "default_us": default * 1e6, "default_GB_s": nbytes / default / 1e9,
                        "best": list(best), "best_us": times[best] * 1e6, "best_GB_s": nbytes / times[best] / 1e9,
                        "bf16_us": bf16 * 1e6, "bf16_GB_s": 2 * nbytes / bf16 / 1e9}
        r = result[name]
        print(f"{name:10} N={n:6} K={k:6}: built-in {r['default_us']:7.1f} us ({r['default_GB_s']:6.0f} GB/s), best "
              f"{best} {r['best_us']:7.1f} us ({r['best_GB_s']:6.0f} GB/s); bf16 small_m {r['bf16_us']:7.1f} us "
              f"({r['bf16_GB_s']:6.0f} GB/s)", flush=True)
        ws = None  # free the memory now (not del: the closures above name them)
    result["TURNOUT_SMALL_M_TILES"] = json.dumps(best_tiles)
    print("TURNOUT_SMALL_M_TILES='" + result["TURNOUT_SMALL_M_TILES"] + "'")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
