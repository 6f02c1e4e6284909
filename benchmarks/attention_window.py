"""Sliding-window decode attention on the GPU: the Triton kernel's loop starts at the window, so decode over a
long context with a window should cost what the window costs, not what the context costs. Times bf16 decode
(8 sequences, 32 query heads, 8 KV heads, head dim 128) with a 4,096-key window over 4,096 and 65,536 tokens of
context, beside full attention over both, and reports the bytes each reads against the copy bandwidth measured in
the same run.

    python benchmarks/attention_window.py
"""

from __future__ import annotations

import torch
from common import copy_bandwidth, machine, report

from turnout.ops.triton import attention

B, HQ, HK, D, BS, WINDOW = 8, 32, 8, 128, 16, 4096


def _args(context: int):
    nb = B * context // BS
    k_cache = torch.randn(nb, BS, HK, D, device="cuda", dtype=torch.bfloat16)  # [blocks, block_size, Hk, D]
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(nb, dtype=torch.int32, device="cuda").view(B, -1)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)  # one new token per sequence
    return (q, k_cache, v_cache, tables, torch.full((B,), context, dtype=torch.int32, device="cuda"),
            torch.arange(B + 1, dtype=torch.int32, device="cuda"), 1, context, D ** -0.5)


def _ms(args, **kw) -> float:
    for _ in range(3):
        attention.paged_attention(*args, **kw)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        attention.paged_attention(*args, **kw)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def main() -> None:
    copy = copy_bandwidth(torch.device("cuda"))  # GB/s
    rows = []
    for context in (4096, 65536):
        args = _args(context)
        for window in (None, WINDOW):
            ms = _ms(args, sliding_window=window)
            keys = min(context, window or context)
            gb = 2 * B * keys * HK * D * 2 / 1e9  # K and V bytes the kernel must read
            rows.append({"context": context, "window": window or "full", "ms": round(ms, 4),
                         "GB/s": round(gb / (ms / 1e3), 1), "% copy": round(100 * gb / (ms / 1e3) / copy, 1)})
        del args
        torch.cuda.empty_cache()
    report("decode attention with a sliding window", rows, ["context", "window", "ms", "GB/s", "% copy"],
           {"machine": machine(), "copy_gb_s": round(copy, 1)})


if __name__ == "__main__":
    main()
