"""Shared benchmark helpers: the hardware ceilings measured in the same run, and output."""

from __future__ import annotations

import json
import platform as _platform
import time

import torch


def _timeit(fn, device, iters: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def copy_bandwidth(device, nbytes: int = 1 << 28, iters: int = 10) -> float:
    """Achieved GB/s of a large copy (bytes read + written)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dt = _timeit(lambda: dst.copy_(src), device, iters)
    return 2 * nbytes / dt / 1e9


def gemm_tflops(device, dtype, n: int = 4096, iters: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    dt = _timeit(lambda: a @ b, device, iters)
    return 2 * n**3 / dt / 1e12


def machine() -> dict:
    info = {"host": _platform.node(), "cpu_threads": torch.get_num_threads(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


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
