"""The default ``max_num_seqs``: as many sequences as the KV cache holds at ``max_model_len``, within bounds.

A fixed 256 left half the cache idle on an H200 (a 512 x (1024 in / 512 out) throughput run held 256
sequences in a cache that had room for more), and a fixed larger number would preempt on small caches. So with
``max_num_seqs=None`` (the default of EngineConfig, ``LLM`` and ``turnout bench``), once the cache is sized:

    default = min(1024, max(256, the sequences of max_model_len tokens the cache holds, rounded down to 16))

Counting at max_model_len (not a typical length) means the sequences admitted can all grow to their limit
without preempting each other; 256 below keeps the old default where the cache is small (sequences then wait
for blocks, as before), and 1024 above bounds the step's batch, the sampler's rows and the graphs captured
(turnout/worker/cuda_graphs.py). An explicit ``max_num_seqs`` is always used as given.
"""

from __future__ import annotations

MIN_DEFAULT_SEQS = 256
MAX_DEFAULT_SEQS = 1024
_ROUND = 16


def default_max_num_seqs(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """The rule above: ``num_blocks`` blocks of ``block_size`` tokens, sequences of ``max_model_len`` tokens."""
    per_seq = -(-int(max_model_len) // int(block_size))  # blocks one full-length sequence takes
    held = int(num_blocks) // max(per_seq, 1)
    return min(MAX_DEFAULT_SEQS, max(MIN_DEFAULT_SEQS, held // _ROUND * _ROUND))


def profile_rows(config) -> int:
    """The logits rows of the start-up memory profile: the most sequences one step may sample (the upper
    bound while ``max_num_seqs`` is still to be chosen)."""
    return config.max_num_seqs or min(MAX_DEFAULT_SEQS, config.max_num_batched_tokens)
