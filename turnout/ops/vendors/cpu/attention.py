"""paged_attention on CPU through torch's scaled_dot_product_attention (GQA via enable_gqa). An fp8 cache
(turnout/ops/kv_cache.py) is gathered as bytes and dequantised (times its scale) to the query's dtype.

A sliding window is a mask, with only the window's blocks gathered (those before it may hold another sequence's
data). SDPA has no soft-cap and no sink logit, so a layer with either takes the reference's dense path."""

import torch
import torch.nn.functional as F

from turnout.ops.kv_cache import FP8_KV


def _gather(cache: torch.Tensor, table: torch.Tensor, n_tokens: int, scale=None, dtype=None,
            first_block: int = 0) -> torch.Tensor:
    # cache [NB, BS, Hk, D], table [..., nblk] -> [..., Hk, n_tokens - first_block * BS, D]
    bs = cache.shape[1]
    nblk = (n_tokens + bs - 1) // bs
    idx = table[..., first_block:nblk]
    fp8 = cache.dtype == FP8_KV
    src = cache.view(torch.uint8) if fp8 else cache  # torch has no fp8 index_select on CPU
    # index_select over whole blocks is a row memcpy; advanced indexing here is ~8x slower on CPU
    kv = src.index_select(0, idx.reshape(-1)).view(*idx.shape, *cache.shape[1:])  # [..., nblk, BS, Hk, D]
    kv = kv.flatten(-4, -3)[..., :n_tokens - first_block * bs, :, :]  # [..., L, Hk, D]
    if fp8:
        kv = kv.view(FP8_KV).float()
        kv = (kv if scale is None else kv * scale.float()).to(dtype)
    return kv.transpose(-3, -2)


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len: int,
                    max_seq_len: int, scale: float, k_scale=None, v_scale=None, *, sliding_window=None,
                    logit_softcap=None, sinks=None):
    if logit_softcap is not None or sinks is not None:
        from turnout.ops.reference.attention import paged_attention as dense

        return dense(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                     scale, k_scale, v_scale, sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks)
    if sliding_window is not None:
        from turnout.ops.reference.attention_variants import check_variants

        check_variants(sliding_window, None, None, query.shape[1])
    hq, d = query.shape[1], query.shape[2]
    ks, vs, dt = k_scale, v_scale, query.dtype
    if max_query_len == 1 and sliding_window is None:
        # Pure decode: one batched SDPA over KV padded to the longest context, masked per sequence.
        b = seq_lens.shape[0]
        k = _gather(k_cache, block_tables, max_seq_len, ks, dt)  # [B, Hk, L, D]
        v = _gather(v_cache, block_tables, max_seq_len, vs, dt)
        valid = torch.arange(max_seq_len, device=query.device)[None, :] < seq_lens[:, None]
        q = query.view(b, hq, 1, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale,
                                             enable_gqa=hq != k.shape[1])
        return out.view(b, hq, d)
    out = torch.empty_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, kv_len in enumerate(lens):
        s, e = qsl[i], qsl[i + 1]
        if s == e:
            continue
        q_len = e - s
        if sliding_window is not None:  # gather from the block holding the first query's window start
            lo = max(0, kv_len - q_len - sliding_window + 1)
            fb = lo // k_cache.shape[1]
            k = _gather(k_cache, block_tables[i], kv_len, ks, dt, fb)[None]  # [1, Hk, L', D]
            v = _gather(v_cache, block_tables[i], kv_len, vs, dt, fb)[None]
            # the block's positions before the window: zeros, so stale data there cannot reach a sum
            k[:, :, : lo - fb * k_cache.shape[1]] = 0
            v[:, :, : lo - fb * k_cache.shape[1]] = 0
            kpos = torch.arange(fb * k_cache.shape[1], kv_len, device=query.device)[None, :]
            qpos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
            mask = (kpos <= qpos) & (kpos > qpos - sliding_window)
            q = query[s:e].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != k.shape[1])
            out[s:e] = o[0].transpose(0, 1)
            continue
        k = _gather(k_cache, block_tables[i], kv_len, ks, dt)[None]  # [1, Hk, L, D]
        v = _gather(v_cache, block_tables[i], kv_len, vs, dt)[None]
        q = query[s:e].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        if q_len == kv_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=hq != k.shape[1])
        else:  # new tokens after a cached prefix: causal with an offset
            qpos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
            mask = torch.arange(kv_len, device=query.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != k.shape[1])
        out[s:e] = o[0].transpose(0, 1)
    return out
