import math

import torch

from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float) -> torch.Tensor:
    """Causal attention of new query tokens over a paged KV cache (prefill with a cached prefix, and decode).

    query: [T, Hq, D], the new tokens of B sequences packed back to back; query_start_loc [B+1] int32
    gives each sequence's slice. k_cache/v_cache: [num_blocks, block_size, Hk, D] already holding the
    keys/values of every token of each sequence, new ones included. block_tables: [B, max_blocks] int32.
    seq_lens: [B] int32, total tokens per sequence (cached + new). The i-th new token of sequence b sits
    at position seq_lens[b] - q_len_b + i and attends to positions 0..that position. Hq is a multiple
    of Hk (GQA). max_query_len / max_seq_len bound the lengths (host ints, so kernels need no sync).
    Returns [T, Hq, D] in query's dtype; softmax in float32.
    """
    out = torch.empty_like(query)
    bs = k_cache.shape[1]
    hq, hk = query.shape[1], k_cache.shape[2]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        q = query[qsl[b]: qsl[b + 1]].float()  # [q_len, Hq, D]
        q_len, kv_len = q.shape[0], lens[b]
        if q_len == 0:
            continue
        nblk = (kv_len + bs - 1) // bs
        blocks = block_tables[b, :nblk].long()
        k = k_cache[blocks].reshape(nblk * bs, hk, -1)[:kv_len].float()
        v = v_cache[blocks].reshape(nblk * bs, hk, -1)[:kv_len].float()
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        kpos = torch.arange(kv_len, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        out[qsl[b]: qsl[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def _samples(device, dtype, gen):
    # (query lens, context lens, Hq, Hk, D, block_size): decode, prefill, prefill over a prefix, mixed.
    cases = [
        ([1, 1, 1], [5, 17, 33], 4, 2, 64, 16),
        ([9, 16], [9, 16], 4, 4, 32, 8),
        ([7, 3], [40, 19], 8, 2, 64, 16),
        ([1, 12, 1, 5], [70, 12, 3, 29], 6, 2, 128, 16),
    ]
    for qlens, kvlens, hq, hk, d, bs in cases:
        b = len(qlens)
        max_blocks = max((k + bs - 1) // bs for k in kvlens)
        nb = b * max_blocks + 3
        k_cache, v_cache = randn((nb, bs, hk, d), dtype, device, gen), randn((nb, bs, hk, d), dtype, device, gen)
        # Each sequence gets scattered, non-contiguous blocks.
        perm = torch.randperm(nb, generator=gen)[: b * max_blocks].view(b, max_blocks)
        qsl = torch.tensor([0] + qlens).cumsum(0)
        yield SampleCase(
            f"q{qlens}-kv{kvlens}-Hq{hq}-Hk{hk}-D{d}-BS{bs}",
            (randn((sum(qlens), hq, d), dtype, device, gen), k_cache, v_cache,
             perm.to(device=device, dtype=torch.int32), torch.tensor(kvlens, dtype=torch.int32, device=device),
             qsl.to(device=device, dtype=torch.int32), max(qlens), max(kvlens), 1.0 / math.sqrt(d)))


PAGED_ATTENTION = OpSpec(
    "paged_attention", paged_attention, _samples,
    tolerance={"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)},
    doc="causal attention of new tokens over a paged KV cache (prefill with prefix, and decode), GQA")
