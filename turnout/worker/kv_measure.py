"""The KV tiers' timings: the start-up costs preemption_mode auto compares, and the swap-in overlap report.

Separate from the copies (worker/kv_transfer.py) because it only drives them: it runs swap-outs, swap-ins
and probe forwards into blocks nothing owns yet, before any request does, and reads the clock around them.
Nothing here runs once the engine serves.
"""

from __future__ import annotations

import time

import torch

from turnout.layers.attention import AttentionMetadata
from turnout.worker.layer_gate import LayerGatedCaches


def _sync(runner) -> None:
    if runner.device.type != "cpu":
        runner.platform.synchronize()


def probe_forward(runner, tokens: int):
    """A forward of one ``tokens``-token sequence into device blocks [0, ceil(tokens / block_size)),
    as ``run(caches)``: for measurements taken before any request owns a block."""
    r = runner
    dev = r.device
    nb = -(-tokens // r.block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens, dtype=torch.long, device=dev),
        block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
        max_query_len=tokens, max_seq_len=tokens, seq_lens_host=(tokens,), query_start_loc_host=(0, tokens))
    ids = torch.zeros(tokens, dtype=torch.long, device=dev)
    pos = torch.arange(tokens, device=dev)
    return lambda caches: r.model(ids, pos, caches, meta)


@torch.inference_mode()
def measure_costs(xfer, config) -> tuple[float, float]:
    """(copy bytes/s, prefill tokens/s) of ``xfer`` (a KVTransfer) on its runner: copy bandwidth (blocks out
    and back) and prefill rate (one forward into blocks nothing owns yet), each the best of two runs: cheap,
    and enough to compare the two costs. On a GPU at the sizes a preemption moves (64 blocks, a 512-token
    chunk): at 8 blocks and 32 tokens an H200 measured launch overhead, 5.9 GB/s and 759 tokens/s, where a
    preemption's sizes run at ~50 GB/s (docs/benchmarks.md, "H200: KV swaps as one kernel a layer") and ~50k
    tokens/s. On a CPU the small sizes keep every engine's start-up short."""
    r = xfer.runner
    blocks, chunk = (64, 512) if r.platform.is_gpu else (8, 32)
    n = max(1, min(blocks, xfer.num_host_blocks, r.num_blocks))
    pairs = [(i, i) for i in range(n)]
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        xfer.swap_out(pairs)
        gate = xfer.swap_in(pairs)
        if gate is not None:
            gate.finish()
        _sync(r)
        best = min(best, time.perf_counter() - t0)
    copy_bytes_per_s = 2 * n * r.block_bytes / best
    tokens = max(1, min(chunk, config.max_num_batched_tokens, r.num_blocks * r.block_size, r.max_model_len))
    forward = probe_forward(r, tokens)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        forward(r.kv_caches)
        _sync(r)
        best = min(best, time.perf_counter() - t0)
    return copy_bytes_per_s, tokens / best


@torch.inference_mode()
def measure_overlap(xfer, num_blocks: int = 64, tokens: int = 2048, iters: int = 5) -> dict:
    """How much of the per-layer async swap-in of ``xfer`` (a KVTransfer) hides behind the forward, from
    device events: the copy of ``num_blocks`` blocks (every layer) alone, a ``tokens``-token forward alone,
    and the forward with that swap-in gated layer by layer (hidden = 1 - (with - alone) / copy). Medians of
    ``iters`` interleaved runs. Only before any request owns a block (it writes blocks nothing owns yet)."""
    r = xfer.runner
    if r.config.tensor_parallel_size > 1:  # its forwards would meet no peer in their collectives
        return {"hidden": None, "why": "n/a (measured on one rank only: tensor_parallel_size 1)"}
    if xfer.strategy is None or xfer.strategy[1] != "swap_layer_async" or not xfer.num_host_blocks:
        why = ("no device streams" if not r.platform.is_gpu else
               "no host blocks" if not xfer.num_host_blocks else f"swap-ins run {xfer.strategy and xfer.strategy[0]}")
        return {"hidden": None, "why": f"n/a ({why})"}
    tokens = max(1, min(tokens, r.config.max_num_batched_tokens))
    first = -(-tokens // r.block_size)
    n = min(num_blocks, xfer.num_host_blocks, r.num_blocks - first)
    pairs = [(h, first + h) for h in range(n)]
    forward = probe_forward(r, tokens)
    mod = getattr(torch, r.device.type)
    main = mod.current_stream(r.device)

    def timed(fn) -> float:
        a, b = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
        a.record(main)
        fn()
        b.record(main)
        b.synchronize()
        return a.elapsed_time(b)

    runs = {"copy": lambda: xfer.swap_in(pairs).finish(), "forward": lambda: forward(r.kv_caches),
            "forward_with_swap_in": lambda: forward(LayerGatedCaches(r.kv_caches, xfer.swap_in(pairs)))}
    ms = {k: [] for k in runs}
    for i in range(iters + 1):  # the first round warms up
        for k, fn in runs.items():
            t = timed(fn)
            if i:
                ms[k].append(t)
    med = {k: sorted(v)[len(v) // 2] for k, v in ms.items()}
    extra = max(0.0, med["forward_with_swap_in"] - med["forward"])
    return {"hidden": max(0.0, 1.0 - extra / med["copy"]) if med["copy"] > 0 else None, "blocks": n,
            "forward_tokens": tokens, "copy_ms": med["copy"], "copy_per_layer_ms": med["copy"] / len(r.kv_caches),
            "forward_ms": med["forward"], "forward_with_swap_in_ms": med["forward_with_swap_in"],
            "copy_GB_s": n * r.block_bytes / med["copy"] / 1e6 if med["copy"] > 0 else None}
