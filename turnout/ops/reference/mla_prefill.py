"""Decompressed prefill of multi-head latent attention: the two ops it adds to the absorbed ones (mla.py).

For a long prefill it is cheaper to decompress the context's latent vectors into per-head keys and values once
(k_nope = W_UK c, v = W_UV c; the layer applies ``kv_b_proj``) and run ordinary causal attention than to attend in
the latent space, whose score and output reads L + R values per query and key pair (vLLM's and SGLang's "MHA"
prefill). The layer (turnout/layers/mla_prefill.py) needs:

- ``mla_gather_cache``: the latent rows of each sequence's whole context, packed back to back, out of the paged
  latent cache, in the compute dtype (an fp8 cache's rows times its ``kv_scale``);
- ``varlen_attention``: causal attention over packed, contiguous per-head keys and values whose head dims differ
  (queries and keys Dn + R, values Dv), the new tokens being the last q_len of each sequence's keys.
"""

from __future__ import annotations

import math

import torch

from turnout.ops.reference._util import randn
from turnout.ops.reference.cache import from_cache
from turnout.ops.reference.mla import paged_batch
from turnout.ops.spec import OpSpec, SampleCase


def mla_gather_cache(latent_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     key_start_loc: torch.Tensor, max_seq_len: int, total_tokens: int, dtype: torch.dtype,
                     kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """latent_cache [NB, BS, W] -> [total_tokens, W] in ``dtype``: rows key_start_loc[b] + j (j < seq_lens[b]) hold
    sequence b's cached position j (block_tables [B, MB] i32, seq_lens [B] i32, key_start_loc [B + 1] i32, its
    last entry total_tokens). ``max_seq_len``: a host bound on seq_lens. An fp8 cache's values times kv_scale."""
    bs, width = latent_cache.shape[1:]
    out = torch.empty((total_tokens, width), dtype=dtype, device=latent_cache.device)
    starts = key_start_loc.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        nblk = -(-ctx // bs)
        rows = latent_cache[block_tables[b, :nblk].long()].reshape(nblk * bs, width)[:ctx]
        out[starts[b]: starts[b] + ctx] = from_cache(rows, kv_scale).to(dtype)
    return out


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor,
                     key_start_loc: torch.Tensor, max_query_len: int, max_key_len: int,
                     scale: float) -> torch.Tensor:
    """query [T, H, Dk], key [S, H, Dk], value [S, H, Dv] -> [T, H, Dv] in query's dtype. Sequence b's queries are
    query_start_loc[b]:[b + 1], its keys key_start_loc[b]:[b + 1] (at least as many); causal with the queries the
    last q_len of its keys (query i of n sees keys j <= ctx - n + i). ``max_query_len`` / ``max_key_len``: host
    bounds. Float32 math."""
    t, h, _ = query.shape
    out = torch.empty((t, h, value.shape[-1]), dtype=query.dtype, device=query.device)
    qsl, ksl = query_start_loc.tolist(), key_start_loc.tolist()
    for b in range(len(qsl) - 1):
        q0, q1, k0, k1 = qsl[b], qsl[b + 1], ksl[b], ksl[b + 1]
        n, ctx = q1 - q0, k1 - k0
        if n == 0:
            continue
        if ctx < n:
            raise ValueError(f"varlen_attention: sequence {b} has {n} queries but {ctx} keys (key_start_loc)")
        q, k, v = query[q0:q1].float(), key[k0:k1].float(), value[k0:k1].float()
        scores = torch.einsum("nhd,jhd->hnj", q, k) * scale
        pos = torch.arange(ctx - n, ctx, device=query.device)[:, None]
        scores = scores.masked_fill(torch.arange(ctx, device=query.device)[None, :] > pos, float("-inf"))
        out[q0:q1] = torch.einsum("hnj,jhd->nhd", torch.softmax(scores, dim=-1), v).to(out.dtype)
    return out


# ------------------------------------------------------------------------------------------------ samples

def _gather_samples(device, dtype, gen):
    # one sequence; several with a scattered table; a context that ends mid-block; an empty sequence
    for label, qlens, ctxs, lat, rope, bs in [("one", [5], [5], 32, 16, 16), ("batch", [3, 1, 7], [40, 1, 19], 48, 16, 8),
                                              ("with-empty", [2, 1], [33, 0], 64, 32, 16)]:
        _, _, cache, tables, seq_lens, _, _, max_seq, _ = paged_batch([max(q, 1) for q in qlens], [max(c, 1) for c in ctxs],
                                                                      1, lat, rope, bs, dtype, device, gen)
        seq_lens = torch.tensor(ctxs, dtype=torch.int32, device=device)
        ksl = torch.tensor([0] + ctxs).cumsum(0).to(device, torch.int32)
        yield SampleCase(f"{label}-L{lat}-R{rope}-BS{bs}", (cache, tables, seq_lens, ksl, max_seq, sum(ctxs), dtype))


def varlen_batch(qlens, ctxs, heads, dk, dv, dtype, device, gen):
    """(query, key, value, query_start_loc, key_start_loc, max_query_len, max_key_len, scale) of a packed batch."""
    t, s = sum(qlens), sum(ctxs)
    query = randn((t, heads, dk), dtype, device, gen)
    key = randn((s, heads, dk), dtype, device, gen)
    value = randn((s, heads, dv), dtype, device, gen)
    qsl = torch.tensor([0] + list(qlens)).cumsum(0).to(device, torch.int32)
    ksl = torch.tensor([0] + list(ctxs)).cumsum(0).to(device, torch.int32)
    return (query, key, value, qsl, ksl, max(qlens), max(ctxs), 1.0 / math.sqrt(dk))


def _attention_samples(device, dtype, gen):
    # a whole prefill; a chunk over a cached prefix next to a prefill and a one-token sequence; head dims that are
    # not powers of two and differ between keys and values (DeepSeek's 192 / 128, scaled down)
    cases = [("prefill", [23], [23], 4, 24, 24), ("chunk-over-prefix", [7, 12, 1], [40, 12, 9], 3, 24, 16),
             ("long-tiles", [70], [130], 2, 48, 32), ("v-wider", [5, 9], [5, 20], 2, 12, 20)]
    for label, qlens, ctxs, heads, dk, dv in cases:
        yield SampleCase(f"{label}-H{heads}-Dk{dk}-Dv{dv}", varlen_batch(qlens, ctxs, heads, dk, dv, dtype, device, gen))


MLA_GATHER_CACHE = OpSpec(
    "mla_gather_cache", mla_gather_cache, _gather_samples,
    tolerance={"float32": (0.0, 0.0), "float16": (0.0, 0.0), "bfloat16": (0.0, 0.0)},
    doc="each sequence's whole context out of the paged latent cache, packed back to back, in the compute dtype")
VARLEN_ATTENTION = OpSpec(
    "varlen_attention", varlen_attention, _attention_samples,
    tolerance={"float32": (2e-5, 2e-5), "float16": (3e-3, 3e-3), "bfloat16": (3e-2, 3e-2)},
    doc="causal attention over packed contiguous per-head keys / values (key and value head dims may differ)")
