"""KV writes on CPU with index_copy_ (padding slots, -1, are filtered first)."""

import torch


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    nb, bs = k_cache.shape[:2]
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))
