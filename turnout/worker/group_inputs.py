"""The step inputs of table groups 1.. (turnout/kv/spec.py: table groups: a model mixing full and sliding layers), and
what a sequence's KV costs per group. Group 0's slot mapping and block tables are the metadata's own fields
(worker/model_runner.py builds them as with one table); these are built beside them, once per step, and only for
a model with several groups.
"""

from __future__ import annotations

from turnout.kv.spec import CacheLayout


def group_tables(scheduled, block_size: int, min_width: int, host) -> tuple:
    """(slot_mapping i64 [T], block_tables i32 [B, width]) of each table group after the first, for the
    scheduled entries (``ScheduledRequest``: ``block_ids[g]`` is group g's table). ``host(list, dtype)`` makes
    the (pinned) host tensor. Each group's tables are padded with block 0 to its own widest (at least
    ``min_width``: group 0's, so a CUDA graph's buffers fit every group alike)."""
    import torch

    out = []
    for g in range(1, len(scheduled[0].block_ids)):
        slots, rows = [], []
        width = max([min_width] + [len(s.block_ids[g]) for s in scheduled])
        for s in scheduled:
            table = s.block_ids[g]
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(s.start, s.start + s.num_query_tokens))
            rows.append(table + [0] * (width - len(table)))
        out.append((host(slots, torch.long), host(rows, torch.int32)))
    return tuple(out)


def seq_kv_bytes(layout: CacheLayout, num_tokens: int, block_size: int) -> tuple[int, list[tuple[str, int, int]]]:
    """A decoding sequence of ``num_tokens`` tokens: (bytes as one table held it, every token layer keeping every
    block; per table group (what, blocks, bytes) as the groups hold it). Arithmetic from the specs."""
    blocks = -(-num_tokens // block_size)
    before = blocks * layout.block_bytes(block_size) if len(layout.table_groups) == 1 else \
        blocks * block_size * sum(s.bytes_per_token for s in layout.specs if s.per_token)
    page = layout.block_bytes(block_size)
    rows = []
    for g in layout.table_groups:
        spec = layout.specs[g.layers[0]]
        n = spec.max_blocks(num_tokens, block_size, 1)
        what = "full" if g.window is None else f"sliding {g.window}"
        rows.append((f"{what} x{len(g.layers)} layers", n, n * page if len(layout.table_groups) > 1 else
                     n * layout.block_bytes(block_size)))
    return before, rows


def kv_bytes_line(layout: CacheLayout, num_tokens: int, block_size: int) -> str:
    """The start-up log line: a sequence's KV at ``num_tokens`` per table group, and as one table held it."""
    before, rows = seq_kv_bytes(layout, num_tokens, block_size)
    after = sum(b for _, _, b in rows)
    parts = "; ".join(f"{what}: {n} blocks {b / 2**30:.3f} GiB" for what, n, b in rows)
    return f"{parts}; total {after / 2**30:.3f} GiB (one block table: {before / 2**30:.3f} GiB)"
