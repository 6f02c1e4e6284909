"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4 MoE Lite) over a paged latent cache.

Each token stores one vector per layer: its normalised compressed kv (``kv_lora_rank`` values, c) followed by
its rotated rope key (``rope_dim`` values, k_pe), shared by every head: ``latent_cache [NB, BS, L + R]``.

Attention runs in the absorbed form: the layer projects each head's no-rope query into the latent space with
that head's slice of W_UK (kv_b_proj), so a head's score against token j is ``q_lat . c_j + q_pe . k_pe_j``, its
output ``sum_j p_j c_j`` is a latent vector, and the layer projects it back with W_UV. This equals attention over
the decompressed keys and values (k_nope = W_UK c, v = W_UV c) by associativity, and reads L + R values per
token instead of H (Dk + Dv): what lets decode read the cache once for all heads.

fp8 cache (turnout/ops/kv_cache.py): one per-tensor ``kv_scale`` [1] f32 for the whole vector (c and k_pe are
one tensor), passed only with an fp8 cache, as the other cache ops take theirs.
"""

from __future__ import annotations

import math

import torch

from turnout.ops.reference._util import randn
from turnout.ops.reference.cache import from_cache, to_cache
from turnout.ops.spec import OpSpec, SampleCase


def mla_reshape_and_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """kv_c [T, L] and k_pe [T, R] into latent_cache [NB, BS, L + R] at slot_mapping [T] (-1 skips): the
    slot's first L values are kv_c, the last R k_pe. An fp8 cache stores ``to_cache(x, fp8, kv_scale)``."""
    nb, bs, width = latent_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows = torch.cat([kv_c[keep], k_pe[keep]], dim=-1)
    if rows.shape[-1] != width:
        raise ValueError(f"kv_c [T, {kv_c.shape[-1]}] + k_pe [T, {k_pe.shape[-1]}] do not fill the latent cache's "
                         f"{width} values per token")
    latent_cache.view(nb * bs, width)[slots] = to_cache(rows, latent_cache.dtype, kv_scale)


def mla_paged_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        max_query_len: int, max_seq_len: int, scale: float,
                        kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q_lat [T, H, L] (queries in the latent space), q_pe [T, H, R] (rotated) over latent_cache [NB, BS, L + R]
    -> [T, H, L] in q_lat's dtype: causal, the new tokens the last q_len of each sequence (as paged_attention).
    scores = scale (q_lat . c + q_pe . k_pe); out = softmax(scores) @ c. Float32 math."""
    t, h, lat = q_lat.shape
    bs = latent_cache.shape[1]
    out = torch.empty_like(q_lat)
    qsl = query_start_loc.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[b], qsl[b + 1]
        if q1 == q0:
            continue
        nblk = -(-ctx // bs)
        rows = latent_cache[block_tables[b, :nblk].long()].reshape(nblk * bs, -1)[:ctx]
        rows = from_cache(rows, kv_scale)  # [ctx, L + R] f32
        c, k_pe = rows[:, :lat], rows[:, lat:]
        ql, qp = q_lat[q0:q1].float(), q_pe[q0:q1].float()  # [n, H, *]
        scores = (torch.einsum("nhl,jl->hnj", ql, c) + torch.einsum("nhr,jr->hnj", qp, k_pe)) * scale
        n = q1 - q0
        pos = torch.arange(ctx - n, ctx, device=scores.device)[:, None]  # each new token's position
        scores = scores.masked_fill(torch.arange(ctx, device=scores.device)[None, :] > pos, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hnj,jl->nhl", p, c).to(out.dtype)
    return out


# ------------------------------------------------------------------------------------------------ samples

def _latent(nb, bs, width, dtype, device, gen):
    return randn((nb, bs, width), dtype, device, gen)


def _cache_samples(device, dtype, gen):
    for t, nb, bs, lat, rope in [(1, 4, 16, 32, 16), (19, 8, 8, 48, 16), (33, 16, 16, 64, 32)]:
        slots = torch.randperm(nb * bs, generator=gen)[:t]
        slots[torch.rand(t, generator=gen) < 0.2] = -1  # padding lanes
        yield SampleCase(f"T{t}-NB{nb}-BS{bs}-L{lat}-R{rope}",
                         (randn((t, lat), dtype, device, gen), randn((t, rope), dtype, device, gen),
                          _latent(nb, bs, lat + rope, dtype, device, gen), slots.to(device)))


def paged_batch(qlens, ctxs, heads, lat, rope, bs, dtype, device, gen, extra_blocks=3):
    """A packed batch of len(qlens) sequences over a scattered paged latent cache, as the engine lays it out:
    (q_lat, q_pe, latent_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale)."""
    b = len(qlens)
    max_blocks = max(-(-c // bs) for c in ctxs)
    nb = b * max_blocks + extra_blocks
    cache = _latent(nb, bs, lat + rope, dtype, device, gen)
    tables = torch.randperm(nb, generator=gen)[: b * max_blocks].view(b, max_blocks).to(device, torch.int32)
    t = sum(qlens)
    # scores of a few units: q_lat . c sums L products, so it is scaled down by sqrt(L)
    q_lat = randn((t, heads, lat), dtype, device, gen, scale=lat ** -0.25)
    q_pe = randn((t, heads, rope), dtype, device, gen, scale=rope ** -0.25)
    qsl = torch.tensor([0] + list(qlens)).cumsum(0).to(device, torch.int32)
    seq_lens = torch.tensor(ctxs, dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt((lat + rope) / 4)
    return (q_lat, q_pe, cache, tables, seq_lens, qsl, max(qlens), max(ctxs), scale)


def _attention_samples(device, dtype, gen):
    # decode batches (one new token each, short and long contexts), a prefill, a chunk over a cached prefix,
    # a mixed step; a latent width that is not a power of two; more heads than one program's tile
    cases = [
        ("decode", [1, 1, 1], [1, 37, 130], 4, 32, 16, 16),
        ("decode-L48-H20", [1, 1], [70, 9], 20, 48, 16, 8),
        ("prefill", [23], [23], 4, 32, 16, 16),
        ("chunk-over-prefix", [7, 1], [40, 25], 4, 64, 32, 16),
        ("mixed", [1, 12, 1, 3], [50, 12, 3, 33], 6, 32, 16, 8),
    ]
    for label, qlens, ctxs, heads, lat, rope, bs in cases:
        yield SampleCase(f"{label}-H{heads}-L{lat}-R{rope}-BS{bs}",
                         paged_batch(qlens, ctxs, heads, lat, rope, bs, dtype, device, gen))


_EXACT = {"float32": (0.0, 0.0), "float16": (0.0, 0.0), "bfloat16": (0.0, 0.0)}

MLA_RESHAPE_AND_CACHE = OpSpec(
    "mla_reshape_and_cache", mla_reshape_and_cache, _cache_samples, mutates=("latent_cache",), tolerance=_EXACT,
    doc="write each token's compressed kv and rope key into the paged latent cache by slot mapping; -1 skips")
MLA_PAGED_ATTENTION = OpSpec(
    "mla_paged_attention", mla_paged_attention, _attention_samples,
    tolerance={"float32": (2e-5, 2e-5), "float16": (3e-3, 3e-3), "bfloat16": (3e-2, 3e-2)},
    doc="multi-head latent attention, absorbed: latent-space queries over the paged latent cache -> latent outputs")
