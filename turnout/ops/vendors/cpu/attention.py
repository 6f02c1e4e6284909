"""paged_attention on CPU through torch's scaled_dot_product_attention (GQA via enable_gqa). An fp8 cache
(turnout/ops/kv_cache.py) is gathered as bytes and dequantised (times its scale) to the query's dtype."""

import torch
import torch.nn.functional as F

from turnout.ops.kv_cache import FP8_KV


def _gather(cache: torch.Tensor, table: torch.Tensor, n_tokens: int, scale=None, dtype=None) -> torch.Tensor:
    # cache [NB, BS, Hk, D], table [..., nblk] -> [..., Hk, n_tokens, D]
    bs = cache.shape[1]
    nblk = (n_tokens + bs - 1) // bs
    idx = table[..., :nblk]
    fp8 = cache.dtype == FP8_KV
    src = cache.view(torch.uint8) if fp8 else cache  # torch has no fp8 index_select on CPU
    # index_select over whole blocks is a row memcpy; advanced indexing here is ~8x slower on CPU
    kv = src.index_select(0, idx.reshape(-1)).view(*idx.shape, *cache.shape[1:])  # [..., nblk, BS, Hk, D]
    kv = kv.flatten(-4, -3)[..., :n_tokens, :, :]  # [..., L, Hk, D]
    if fp8:
        kv = kv.view(FP8_KV).float()
        kv = (kv if scale is None else kv * scale.float()).to(dtype)
    return kv.transpose(-3, -2)


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len: int,
                    max_seq_len: int, scale: float, k_scale=None, v_scale=None):
    hq, d = query.shape[1], query.shape[2]
    ks, vs, dt = k_scale, v_scale, query.dtype
    if max_query_len == 1:
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
        k = _gather(k_cache, block_tables[i], kv_len, ks, dt)[None]  # [1, Hk, L, D]
        v = _gather(v_cache, block_tables[i], kv_len, vs, dt)[None]
        q = query[s:e].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        q_len = e - s
        if q_len == kv_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=hq != k.shape[1])
        else:  # new tokens after a cached prefix: causal with an offset
            qpos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
            mask = torch.arange(kv_len, device=query.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != k.shape[1])
        out[s:e] = o[0].transpose(0, 1)
    return out
