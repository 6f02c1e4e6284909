"""KV writes on CPU with index_copy_ (padding slots, -1, are filtered first). An fp8 cache
(turnout/ops/kv_cache.py) takes the reference's quantisation, copied in as bytes: torch has no fp8
index_copy_ on CPU."""

import torch

from turnout.ops.kv_cache import FP8_KV
from turnout.ops.reference.cache import to_cache


def _rows(cache: torch.Tensor) -> torch.Tensor:
    nb, bs = cache.shape[:2]
    rows = cache.view(nb * bs, *cache.shape[2:])
    return rows.view(torch.uint8) if cache.dtype == FP8_KV else rows


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    k, v = to_cache(key, k_cache.dtype, k_scale), to_cache(value, v_cache.dtype, v_scale)
    if k_cache.dtype == FP8_KV:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    _rows(k_cache).index_copy_(0, slots, k)
    _rows(v_cache).index_copy_(0, slots, v)
