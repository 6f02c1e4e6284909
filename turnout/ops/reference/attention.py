import math

import torch

from turnout.ops.reference._util import randn
from turnout.ops.reference.attention_variants import attend, check_variants, window_start
from turnout.ops.spec import OpSpec, SampleCase


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, *, sliding_window: int | None = None,
                    logit_softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of new query tokens over a paged KV cache (prefill with a cached prefix, and decode).

    query: [T, Hq, D], the new tokens of B sequences packed back to back; query_start_loc [B+1] int32
    gives each sequence's slice. k_cache/v_cache: [num_blocks, block_size, Hk, D] already holding the
    keys/values of every token of each sequence, new ones included. block_tables: [B, max_blocks] int32.
    seq_lens: [B] int32, total tokens per sequence (cached + new). The i-th new token of sequence b sits
    at position seq_lens[b] - q_len_b + i and attends to positions 0..that position. Hq is a multiple
    of Hk (GQA). max_query_len / max_seq_len bound the lengths (host ints, so kernels need no sync).
    Returns [T, Hq, D] in query's dtype; softmax in float32. An fp8 cache (turnout/ops/kv_cache.py) is read
    as fp8 * k_scale / v_scale ([1] float32 each).

    ``sliding_window``, ``logit_softcap``, ``sinks``: the variants of turnout/ops/reference/attention_variants.py.
    Only the blocks holding some query's window are read (the others may hold another sequence's data).
    """
    from turnout.ops.reference.cache import from_cache

    check_variants(sliding_window, logit_softcap, sinks, query.shape[1])
    out = torch.empty_like(query)
    bs = k_cache.shape[1]
    hq, hk = query.shape[1], k_cache.shape[2]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        q = query[qsl[b]: qsl[b + 1]]  # [q_len, Hq, D]
        q_len, kv_len = q.shape[0], lens[b]
        if q_len == 0:
            continue
        lo = window_start(kv_len - q_len, sliding_window)  # first key any of these queries reads
        first, nblk = lo // bs, (kv_len + bs - 1) // bs
        blocks = block_tables[b, first:nblk].long()
        k = from_cache(k_cache[blocks].reshape(-1, hk, k_cache.shape[-1])[lo - first * bs: kv_len - first * bs],
                       k_scale)
        v = from_cache(v_cache[blocks].reshape(-1, hk, v_cache.shape[-1])[lo - first * bs: kv_len - first * bs],
                       v_scale)
        qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        kpos = torch.arange(lo, kv_len, device=q.device)
        o = attend(q, k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1), qpos, kpos, scale,
                   sliding_window, logit_softcap, sinks)
        out[qsl[b]: qsl[b + 1]] = o.to(query.dtype)
    return out


def poison_before_window(k_cache, v_cache, tables, qlens, kvlens, sliding_window) -> None:
    """NaN into every cached position no query of its sequence may read (before its first query's window):
    an implementation that reads one, even to multiply it by zero, returns NaN there."""
    bs = k_cache.shape[1]
    for b, (ql, kl) in enumerate(zip(qlens, kvlens)):
        for p in range(window_start(kl - ql, sliding_window)):
            blk = int(tables[b, p // bs])
            k_cache[blk, p % bs] = float("nan")
            v_cache[blk, p % bs] = float("nan")


def variant_kwargs(hq, window, cap, sinks, device, gen) -> dict:
    """The keyword arguments of one sample's variants (sinks drawn per head, a few units either way)."""
    kw = {}
    if window is not None:
        kw["sliding_window"] = window
    if cap is not None:
        kw["logit_softcap"] = cap
    if sinks:
        kw["sinks"] = randn((hq,), torch.float32, device, gen, 2.0)
    return kw


def variant_label(kw: dict) -> str:
    return "".join([f"-W{kw['sliding_window']}" if "sliding_window" in kw else "",
                    f"-cap{kw['logit_softcap']:g}" if "logit_softcap" in kw else "",
                    "-sinks" if "sinks" in kw else ""])


# (query lens, context lens, Hq, Hk, D, block_size, window, softcap, sinks): decode, prefill, prefill over a prefix,
# mixed; then every variant at decode (long contexts: the split path), prefill and chunked prefill, and head dims
# that are not powers of two (the padded columns are masked).
_CASES = [
    ([1, 1, 1], [5, 17, 33], 4, 2, 64, 16, None, None, False),
    ([9, 16], [9, 16], 4, 4, 32, 8, None, None, False),
    ([7, 3], [40, 19], 8, 2, 64, 16, None, None, False),
    ([1, 12, 1, 5], [70, 12, 3, 29], 6, 2, 128, 16, None, None, False),
    ([1, 6], [21, 6], 4, 2, 80, 16, None, None, False),
    ([1, 1, 1], [70, 9, 130], 4, 2, 64, 16, 20, None, False),
    ([9, 16], [9, 16], 4, 4, 32, 8, 4, None, False),
    ([7, 3], [40, 19], 8, 2, 64, 16, 8, None, False),
    ([1, 12, 1, 5], [70, 12, 3, 29], 6, 2, 64, 16, None, 2.0, False),
    ([1, 6, 1], [21, 6, 90], 4, 2, 96, 16, None, None, True),
    ([1, 1, 3], [50, 33, 20], 8, 2, 72, 16, 16, 5.0, True),
    ([1, 4], [20, 4], 2, 1, 192, 16, None, None, False),
]


def _samples(device, dtype, gen):
    for qlens, kvlens, hq, hk, d, bs, window, cap, sinks in _CASES:
        b = len(qlens)
        max_blocks = max((k + bs - 1) // bs for k in kvlens)
        nb = b * max_blocks + 3
        k_cache, v_cache = randn((nb, bs, hk, d), dtype, device, gen), randn((nb, bs, hk, d), dtype, device, gen)
        # Each sequence gets scattered, non-contiguous blocks.
        perm = torch.randperm(nb, generator=gen)[: b * max_blocks].view(b, max_blocks)
        poison_before_window(k_cache, v_cache, perm, qlens, kvlens, window)
        qsl = torch.tensor([0] + qlens).cumsum(0)
        kw = variant_kwargs(hq, window, cap, sinks, device, gen)
        yield SampleCase(
            f"q{qlens}-kv{kvlens}-Hq{hq}-Hk{hk}-D{d}-BS{bs}{variant_label(kw)}",
            (randn((sum(qlens), hq, d), dtype, device, gen), k_cache, v_cache,
             perm.to(device=device, dtype=torch.int32), torch.tensor(kvlens, dtype=torch.int32, device=device),
             qsl.to(device=device, dtype=torch.int32), max(qlens), max(kvlens), 1.0 / math.sqrt(d)), kw)


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
                           v_scale: torch.Tensor | None = None, *, sliding_window: int | None = None,
                           logit_softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
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
                           scale, k_scale, v_scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
                           sinks=sinks)


def _rotary_samples(device, dtype, gen):
    from turnout.ops.reference.rotary import make_cos_sin_cache

    # (query lens, context lens, Hq, Hk, D, rot, neox, qk norm, block size, window, softcap, sinks): decode as
    # Qwen3 (norm, full neox rope), as Llama (no norm), GLM-like partial neox rope, gptj pairs, a padding lane,
    # one prefill; then the variants at decode and prefill, with head dims that are not powers of two.
    cases = [
        ([1, 1], [5, 33], 8, 2, 64, 64, True, True, 16, None, None, False),
        ([1, 1, 1], [17, 1, 40], 4, 4, 32, 32, True, False, 8, None, None, False),
        ([1], [70], 8, 1, 128, 64, True, True, 16, None, None, False),
        ([1, 1], [9, 24], 6, 2, 32, 16, False, True, 4, None, None, False),
        ([1, 1], [12, 3], 4, 2, 64, 64, False, False, 16, None, None, False),
        ([4, 1], [9, 30], 4, 2, 32, 32, True, True, 8, None, None, False),
        ([1, 1], [90, 7], 4, 2, 96, 96, True, True, 16, 24, 3.0, True),
        ([1, 1, 1], [40, 2, 75], 4, 1, 80, 40, True, False, 16, 10, None, False),
        ([5, 1], [9, 30], 4, 2, 72, 72, True, True, 8, 6, None, True),
    ]
    for i, (qlens, kvlens, hq, hk, d, rot, neox, norm, bs, window, cap, sinks) in enumerate(cases):
        b, t = len(qlens), sum(qlens)
        max_blocks = max((k + bs - 1) // bs for k in kvlens)
        nb = b * max_blocks + 3
        k_cache, v_cache = randn((nb, bs, hk, d), dtype, device, gen), randn((nb, bs, hk, d), dtype, device, gen)
        tables = torch.randperm(nb, generator=gen)[: b * max_blocks].view(b, max_blocks)
        poison_before_window(k_cache, v_cache, tables, qlens, kvlens, window)
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
        variants = variant_kwargs(hq, window, cap, sinks, device, gen)
        yield SampleCase(
            f"q{qlens}-kv{kvlens}-Hq{hq}-Hk{hk}-D{d}-rot{rot}-{'neox' if neox else 'gptj'}{'-norm' if norm else ''}"
            f"{variant_label(variants)}",
            (torch.tensor(positions, device=device), q, k, v, qw, kw, 1e-6, make_cos_sin_cache(rot, 128).to(device),
             neox, k_cache, v_cache, torch.tensor(slots, device=device), tables.to(device=device, dtype=torch.int32),
             torch.tensor(kvlens, dtype=torch.int32, device=device), qsl.to(device=device, dtype=torch.int32),
             max(qlens), max(kvlens), 1.0 / math.sqrt(d)), variants)


ROTARY_PAGED_ATTENTION = OpSpec(
    "rotary_paged_attention", rotary_paged_attention, _rotary_samples, mutates=("k_cache", "v_cache"),
    tolerance={"float32": (2e-5, 2e-5), "float16": (1e-2, 1e-2), "bfloat16": (6e-2, 2e-2)},
    doc="optional q/k RMSNorm, RoPE, cache write and paged attention in one op (one kernel at decode)")
