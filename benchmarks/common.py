"""Shared benchmark helpers: the hardware ceilings measured in the same run, and output."""

from __future__ import annotations

import json
import os
import sys

# The measuring code lives in the package (turnout bench uses it too); re-exported here.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from turnout.utils.roofline import copy_bandwidth, gemm_tflops, machine, measure_ceilings  # noqa: E402,F401


def graph_replay_rounds(graph, reps: int, rounds: int = 3) -> list[float]:
    """ms per replay of a captured CUDA graph, one value per round of ``reps`` back-to-back replays (timed
    with CUDA events); callers report the best."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(rounds):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / reps)
    return out


def report(title: str, rows: list[dict], cols: list[str], extra: dict) -> None:
    """Print a table then one JSON line (for docs/benchmarks.md and the GPU suite summary)."""
    print(f"\n== {title}")
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols))
    print("JSON " + json.dumps({"title": title, "rows": rows, **extra}))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return "-" if v is None else str(v)
