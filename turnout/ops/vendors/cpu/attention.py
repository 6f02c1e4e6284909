"""paged_attention on CPU through torch's scaled_dot_product_attention (GQA via enable_gqa)."""

import torch
import torch.nn.functional as F


def _gather(cache: torch.Tensor, table: torch.Tensor, n_tokens: int) -> torch.Tensor:
    # cache [NB, BS, Hk, D], table [..., nblk] -> [..., Hk, n_tokens, D]
    bs = cache.shape[1]
    nblk = (n_tokens + bs - 1) // bs
    idx = table[..., :nblk]
    # index_select over whole blocks is a row memcpy; advanced indexing here is ~8x slower on CPU
    kv = cache.index_select(0, idx.reshape(-1)).view(*idx.shape, *cache.shape[1:])  # [..., nblk, BS, Hk, D]
    kv = kv.flatten(-4, -3)[..., :n_tokens, :, :]  # [..., L, Hk, D]
    return kv.transpose(-3, -2)


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len: int,
                    max_seq_len: int, scale: float):
    hq, d = query.shape[1], query.shape[2]
    if max_query_len == 1:
        # Pure decode: one batched SDPA over KV padded to the longest context, masked per sequence.
        b = seq_lens.shape[0]
        k = _gather(k_cache, block_tables, max_seq_len)  # [B, Hk, L, D]
        v = _gather(v_cache, block_tables, max_seq_len)
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
        k = _gather(k_cache, block_tables[i], kv_len)[None]  # [1, Hk, L, D]
        v = _gather(v_cache, block_tables[i], kv_len)[None]
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
