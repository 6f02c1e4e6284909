"""Rotary embedding, the KV cache write and paged attention through FlagGems, in turnout's contracts
(turnout/ops/reference/rotary.py, cache.py, attention.py). A call shape FlagGems does not serve goes to
``fallback``, the next implementation in the policy's order (bound at resolution: Impl(delegates=True)),
with the reason logged once; nothing else is computed in its place."""

from __future__ import annotations

import torch

from turnout_flaggems.library import decline

_HALF = (torch.float16, torch.bfloat16)
_ones: dict = {}


def _one(device) -> torch.Tensor:
    """A [1] float32 1.0 on ``device``: the unit scales FlagGems' cache write takes for a cache in the
    model's dtype (made once per device, not per call)."""
    t = _ones.get(device)
    if t is None:
        t = _ones[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def rotary_embedding(positions, query, key, cos_sin_cache, is_neox, *, gems, fallback):
    """In place on the first rot_dim dims of each head of query [T, Hq, D] and key [T, Hk, D] (strided views
    of a fused qkv allowed). FlagGems rotates a whole head of size 2 x its cos/sin width, so a partial rotary
    passes the views [..., :rot_dim]; its in-place kernel follows their strides. cos_sin_cache [max_pos,
    rot_dim] holds cos then sin: two column slices, each contiguous in its last dimension as FlagGems asks."""
    if query.shape[-1] != key.shape[-1]:
        decline("rotary_embedding", "query and key head sizes differ (FlagGems rotates both alike)")
        return fallback(positions, query, key, cos_sin_cache, is_neox)
    if positions.numel() == 0:
        return None
    rot = cos_sin_cache.shape[-1]
    q = query if rot == query.shape[-1] else query[..., :rot]
    k = key if rot == key.shape[-1] else key[..., :rot]
    gems.apply_rotary_pos_emb(q, k, cos_sin_cache[:, : rot // 2], cos_sin_cache[:, rot // 2:],
                              position_ids=positions, rotary_interleaved=not is_neox, inplace=True)
    return None


def _dense_cache(c: torch.Tensor) -> bool:
    """Whether a cache [NB, BS, Hk, D] is laid out as FlagGems' write addresses it (a block stride of its
    own, everything inside a block dense)."""
    _, _, h, d = c.shape
    return c.stride(3) == 1 and c.stride(2) == d and c.stride(1) == h * d


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, *, gems, fallback):
    """key / value [T, Hk, D] into the caches at slot_mapping (slot -1 skipped, as FlagGems does too), via
    ``reshape_and_cache_flash`` (its NHD layout is turnout's [NB, BS, Hk, D]). FlagGems stores the values as
    they are (no fp8 conversion), so an fp8 cache is not its case; it reads a token's heads as one dense
    row, so a key whose heads are strided is made dense first."""
    if k_scale is not None or k_cache.dtype != key.dtype or v_cache.dtype != value.dtype:
        decline("reshape_and_cache", f"a {k_cache.dtype} cache for {key.dtype} values (FlagGems stores values "
                "as they are: no fp8 conversion)")
        return fallback(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if not (_dense_cache(k_cache) and _dense_cache(v_cache) and k_cache.stride(0) == v_cache.stride(0)):
        decline("reshape_and_cache", "a cache not dense inside its blocks")
        return fallback(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    d = key.shape[-1]
    if key.stride(2) != 1 or key.stride(1) != d:
        key = key.contiguous()
    if value.stride(2) != 1 or value.stride(1) != d:
        value = value.contiguous()
    one = _one(key.device)
    gems.reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping, "auto", one, one)
    return None


# FlagGems 5.0.2's windowed flash attention wrote NaN where the reference has numbers in both windowed sample
# cases that reached it in `turnout ops --check` on an H100 (2026-12-07: batches of 3 and 2 sequences, W 20 and
# 8). Until a FlagGems release passes them, windowed calls go to the next implementation; the window mapping
# below stays (tests/ops/test_flaggems_mapping.py checks it with this switched on).
SERVE_WINDOWS = False


def _attention_refusal(query, k_cache, k_scale, sinks, sliding_window=None) -> str | None:
    """Why FlagGems' flash attention cannot serve this call, or None."""
    d = query.shape[-1]
    if sliding_window is not None and not SERVE_WINDOWS:
        return "a sliding window (FlagGems 5.0.2's windowed flash attention wrote NaN in turnout's conformance cases)"
    if k_scale is not None or k_cache.dtype != query.dtype:
        return f"a {k_cache.dtype} KV cache (FlagGems' flash attention reads the cache in the query's dtype)"
    if query.dtype not in _HALF:
        return f"{query.dtype} queries (FlagGems' flash attention takes float16 and bfloat16)"
    if sinks is not None:
        return "attention sinks (FlagGems' flash attention has no sink logit)"
    if d > 256 or d % 8:
        return f"head size {d} (FlagGems' flash attention takes multiples of 8 up to 256)"
    if query.shape[1] % k_cache.shape[2]:
        return "query heads not a multiple of the KV heads"
    return None


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                    scale, k_scale=None, v_scale=None, *, sliding_window=None, logit_softcap=None, sinks=None,
                    gems, fallback):
    """FlagGems' ``flash_attn_varlen_func`` over the block table: cu_seqlens_q = query_start_loc, seqused_k =
    seq_lens, causal (its mask is aligned to the bottom right: the new tokens are the last of each sequence,
    as turnout's contract says). turnout's window W keeps keys p - W < j <= p, FlagGems' (left, right) keeps
    p - left <= j <= p + right: (W - 1, 0). Soft-cap 0 means none there."""
    why = _attention_refusal(query, k_cache, k_scale, sinks, sliding_window)
    if why is not None:
        decline("paged_attention", why)
        return fallback(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                        max_seq_len, scale, k_scale, v_scale, sliding_window=sliding_window,
                        logit_softcap=logit_softcap, sinks=sinks)
    return gems.flash_attn_varlen_func(
        query, k_cache, v_cache, max_query_len, query_start_loc, max_seq_len, seqused_k=seq_lens,
        softmax_scale=scale, causal=True, window_size=None if sliding_window is None else (sliding_window - 1, 0),
        softcap=0.0 if logit_softcap is None else float(logit_softcap), block_table=block_tables)
