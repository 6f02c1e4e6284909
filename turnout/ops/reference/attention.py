import math

import torch

from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of new query tokens over a paged KV cache (prefill with a cached prefix, and decode).

    query: [T, Hq, D], the new tokens of B sequences packed back to back; query_start_loc [B+1] int32
    gives each sequence's slice. k_cache/v_cache: [num_blocks, block_size, Hk, D] already holding the
    keys/values of every token of each sequence, new ones included. block_tables: [B, max_blocks] int32.
    seq_lens: [B] int32, total tokens per sequence (cached + new). The i-th new token of sequence b sits
    at position seq_lens[b] - q_len_b + i and attends to positions 0..that position. Hq is a multiple
    of Hk (GQA). max_query_len / max_seq_len bound the lengths (host ints, so kernels need no sync).
    Returns [T, Hq, D] in query's dtype; softmax in float32. An fp8 cache (turnout/ops/kv_cache.py) is read
    as fp8 * k_scale / v_scale ([1] float32 each).
    """
    from turnout.ops.reference.cache import from_cache

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
        k = from_cache(k_cache[blocks].reshape(nblk * bs, hk, -1)[:kv_len], k_scale)
        v = from_cache(v_cache[blocks].reshape(nblk * bs, hk, -1)[:kv_len], v_scale)
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
        ([1, 6], [21, 6], 4, 2, 80, 16),  # a head dim below its power of two: the padded columns are masked
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


def rotary_paged_attention(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                           cos_sin_cache: torch.Tensor, is_neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                           scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """An attention block's middle as one op: per-head RMSNorm of q and k (when ``q_weight`` / ``k_weight``
    are given; both or neither), RoPE, the new k and v into the paged cache, then ``paged_attention``.

    query [T, Hq, D], key / value [T, Hk, D] (strided views of a fused qkv are fine) are not modified.
    Writes k_cache / v_cache at slot_mapping (-1 skips); returns [T, Hq, D]. At decode the Triton kernel
    does all of it inside the attention kernel (no separate norm/RoPE/cache kernel, no round trip).
    """
    from turnout.ops.reference.cache import reshape_and_cache
    from turnout.ops.reference.rotary import qk_norm_rotary, rotary_embedding

    if (q_weight is None) != (k_weight is None):
        raise ValueError("rotary_paged_attention: give both q_weight and k_weight, or neither")
    q, k = query.clone(), key.clone()
    if q_weight is not None:
        qk_norm_rotary(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, is_neox)
    else:
        rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    reshape_and_cache(k, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                           scale, k_scale, v_scale)


def _rotary_samples(device, dtype, gen):
    from turnout.ops.reference.rotary import make_cos_sin_cache

    # (query lens, context lens, Hq, Hk, D, rot, neox, qk norm, block size): decode as Qwen3 (norm, full neox
    # rope), as Llama (no norm), GLM-like partial neox rope, gptj pairs, a padding lane, one prefill.
    cases = [
        ([1, 1], [5, 33], 8, 2, 64, 64, True, True, 16),
        ([1, 1, 1], [17, 1, 40], 4, 4, 32, 32, True, False, 8),
        ([1], [70], 8, 1, 128, 64, True, True, 16),
        ([1, 1], [9, 24], 6, 2, 32, 16, False, True, 4),
        ([1, 1], [12, 3], 4, 2, 64, 64, False, False, 16),
        ([4, 1], [9, 30], 4, 2, 32, 32, True, True, 8),
    ]
    for i, (qlens, kvlens, hq, hk, d, rot, neox, norm, bs) in enumerate(cases):
        b, t = len(qlens), sum(qlens)
        max_blocks = max((k + bs - 1) // bs for k in kvlens)
        nb = b * max_blocks + 3
        k_cache, v_cache = randn((nb, bs, hk, d), dtype, device, gen), randn((nb, bs, hk, d), dtype, device, gen)
        tables = torch.randperm(nb, generator=gen)[: b * max_blocks].view(b, max_blocks)
        positions, slots = [], []
        for s, (ql, kl) in enumerate(zip(qlens, kvlens)):
            for p in range(kl - ql, kl):
                positions.append(p)
                slots.append(int(tables[s, p // bs]) * bs + p % bs)
        if i == 1:
            slots[0] = -1  # a padding lane: nothing written, its output is not used
        qkv = randn((t, (hq + 2 * hk) * d), dtype, device, gen)
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
        v = qkv[:, (hq + hk) * d:].view(t, hk, d)
        qw = randn((d,), dtype, device, gen, 0.5) + 1 if norm else None
        kw = randn((d,), dtype, device, gen, 0.5) + 1 if norm else None
        qsl = torch.tensor([0] + qlens).cumsum(0)
        yield SampleCase(
            f"q{qlens}-kv{kvlens}-Hq{hq}-Hk{hk}-D{d}-rot{rot}-{'neox' if neox else 'gptj'}{'-norm' if norm else ''}",
            (torch.tensor(positions, device=device), q, k, v, qw, kw, 1e-6, make_cos_sin_cache(rot, 128).to(device),
             neox, k_cache, v_cache, torch.tensor(slots, device=device), tables.to(device=device, dtype=torch.int32),
             torch.tensor(kvlens, dtype=torch.int32, device=device), qsl.to(device=device, dtype=torch.int32),
             max(qlens), max(kvlens), 1.0 / math.sqrt(d)))


ROTARY_PAGED_ATTENTION = OpSpec(
    "rotary_paged_attention", rotary_paged_attention, _rotary_samples, mutates=("k_cache", "v_cache"),
    tolerance={"float32": (2e-5, 2e-5), "float16": (1e-2, 1e-2), "bfloat16": (6e-2, 2e-2)},
    doc="optional q/k RMSNorm, RoPE, cache write and paged attention in one op (one kernel at decode)")
