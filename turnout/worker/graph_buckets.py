"""Which decode steps replay a CUDA graph (worker/cuda_graphs.py): the batch sizes captured, the bucket a
batch pads to, and the shape test. Plain integers, no device."""

from __future__ import annotations

import bisect

# Larger decode batches run eagerly: launch overhead is amortised there. 1024 is the largest default
# max_num_seqs (turnout/worker/concurrency.py), so a default engine replays every decode batch.
MAX_GRAPH_BATCH = 1024
# Up to here every multiple of 8 is captured; above, every multiple of 32 (a padded lane costs a 32nd of a
# step's batch at most there, and the capture count stays bounded: 59 graphs for 1024, 43 for 512)
FINE_GRAPH_BATCH = 256


def graph_buckets(max_num_seqs: int, max_bucket: int = MAX_GRAPH_BATCH) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, every multiple of 8 up to 256, then every multiple of 32, up to
    min(max_num_seqs, max_bucket), which is always the last bucket."""
    top = max(1, min(int(max_num_seqs), int(max_bucket)))
    sizes = {b for b in (1, 2, 4) if b < top} | set(range(8, min(top, FINE_GRAPH_BATCH + 1), 8))
    sizes |= set(range(FINE_GRAPH_BATCH + 32, top, 32)) | {top}
    return sorted(sizes)


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``n`` lanes; None when ``n`` is larger than every bucket."""
    if n < 1:
        return None
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def is_graphable(num_tokens: int, num_seqs: int, num_sampled: int, max_query_len: int, table_width: int,
                 max_table_width: int, buckets: list[int]) -> bool:
    """A step replays a graph when it is pure decode (one token per sequence, every sequence samples),
    fits a bucket, and its block tables fit the static ones."""
    return (max_query_len == 1 and num_tokens == num_seqs == num_sampled and table_width <= max_table_width
            and bucket_for(num_seqs, buckets) is not None)


def multi_token_buckets(buckets: list[int], query_len: int) -> list[int]:
    """The batch sizes captured at query length ``query_len`` > 1: those whose tokens fit the largest bucket."""
    return [b for b in buckets if b * query_len <= buckets[-1]]
