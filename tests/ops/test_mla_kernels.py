"""The MLA ops' Triton kernels beyond the generic conformance cases: every split count (empty splits included),
blocks past a context that hold NaN, an fp8 latent cache, and the absorbed form against attention over the
decompressed keys and values (what transformers computes). CPU: the Triton interpreter (tests/conftest.py),
float32 and float16; the gpu-marked case runs DeepSeek-V3's attention shape in bfloat16."""

from __future__ import annotations

import pytest
import torch

from turnout.ops.kv_cache import FP8_KV
from turnout.ops.reference import mla as ref
from turnout.ops.triton import mla

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def _batch(qlens, ctxs, heads=5, lat=32, rope=16, bs=8, dtype=torch.float32, seed=0):
    return ref.paged_batch(qlens, ctxs, heads, lat, rope, bs, dtype, DEV, torch.Generator().manual_seed(seed))


def _close(got, want, tol):
    err = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), f"max error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 2, 5, 16])
def test_decode_every_split_count_matches_the_reference(dtype, splits):
    # contexts of 1 and 3 tokens leave most of 16 splits empty; the merge must weigh those 0
    args = _batch([1, 1, 1, 1], [1, 3, 29, 77], dtype=dtype)
    want = ref.mla_paged_attention(*args)
    _close(mla.mla_paged_attention(*args, num_splits=splits), want, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qb", [1, 2, 4, 8])
def test_prefill_programs_of_several_tokens_match_the_reference(dtype, qb):
    """Prefill chunks (over cached prefixes, of lengths that do not divide by qb, a decode among them): each program
    takes qb tokens of one sequence, each row its own causal limit; programs past the last sequence do nothing."""
    args = _batch([7, 1, 13, 2], [20, 9, 13, 40], dtype=dtype)
    want = ref.mla_paged_attention(*args)
    _close(mla.mla_paged_attention(*args, tiles={"qb": qb}), want, TOL[dtype])


def test_positions_past_the_context_are_never_read():
    args = list(_batch([1, 5], [13, 21]))
    cache, tables, seq_lens = args[2], args[3], args[4]
    bs = cache.shape[1]
    for b, ctx in enumerate(seq_lens.tolist()):  # the tail of each last block, and every later table entry
        last = tables[b, (ctx - 1) // bs].long()
        cache[last, (ctx - 1) % bs + 1:] = float("nan")
        for blk in tables[b, -(-ctx // bs):].long().tolist():
            cache[blk] = float("nan")
    out = mla.mla_paged_attention(*args, num_splits=3)
    assert not out.isnan().any()
    _close(out, ref.mla_paged_attention(*args), TOL[torch.float32])


def test_the_absorbed_form_equals_attention_over_decompressed_keys_and_values():
    """What the model relies on: q_nope W_UK . c == q_nope . (W_UK c) and (p c) W_UV == p (W_UV c)."""
    g = torch.Generator().manual_seed(3)
    h, dn, dv, lat, rope, n = 3, 8, 12, 32, 16, 9
    w_uk, w_uv = torch.randn(h, dn, lat, generator=g), torch.randn(h, dv, lat, generator=g)
    c, k_pe = torch.randn(n, lat, generator=g), torch.randn(n, rope, generator=g)
    q_nope, q_pe = torch.randn(n, h, dn, generator=g), torch.randn(n, h, rope, generator=g)
    scale = 0.2
    cache = torch.cat([c, k_pe], -1).view(n, 1, lat + rope)  # one token per block
    tables = torch.arange(n, dtype=torch.int32)[None]
    q_lat = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)
    o_lat = mla.mla_paged_attention(q_lat, q_pe, cache, tables, torch.tensor([n], dtype=torch.int32),
                                    torch.tensor([0, n], dtype=torch.int32), n, n, scale)
    ours = torch.einsum("nhl,hvl->nhv", o_lat, w_uv)
    k = torch.cat([torch.einsum("hdl,jl->jhd", w_uk, c), k_pe[:, None].expand(n, h, rope)], -1)
    v = torch.einsum("hvl,jl->jhv", w_uv, c)
    q = torch.cat([q_nope, q_pe], -1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    theirs = torch.einsum("hij,jhv->ihv", s.softmax(-1), v)
    _close(ours, theirs, 1e-4)


def test_fp8_latent_cache_write_and_read():
    g = torch.Generator().manual_seed(5)
    t, lat, rope, nb, bs = 11, 32, 16, 6, 4
    kv_c, k_pe = torch.randn(t, lat, generator=g), torch.randn(t, rope, generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[2] = -1
    scale = torch.tensor([0.02])
    want = torch.zeros(nb, bs, lat + rope, dtype=FP8_KV)
    got = torch.zeros(nb, bs, lat + rope, dtype=FP8_KV)
    ref.mla_reshape_and_cache(kv_c, k_pe, want, slots, kv_scale=scale)
    mla.mla_reshape_and_cache(kv_c, k_pe, got, slots, kv_scale=scale)
    assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    args = list(_batch([1, 3], [17, 9], lat=lat, rope=rope))
    args[2] = (args[2].float() / 0.05).clamp(-448, 448).to(FP8_KV)
    s = torch.tensor([0.05])
    _close(mla.mla_paged_attention(*args, kv_scale=s, num_splits=2), ref.mla_paged_attention(*args, kv_scale=s),
           1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("batch,ctx", [(64, 4096), (256, 1024), (3, 700)])
def test_deepseek_v3_shape_bf16_on_gpu(batch, ctx):
    args = _batch([1] * batch, [ctx] * batch, heads=128, lat=512, rope=64, bs=16, dtype=torch.bfloat16)
    _close(mla.mla_paged_attention(*args), ref.mla_paged_attention(*args), 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fp8", [False, True])
def test_deepseek_v3_shape_prefill_bf16_on_gpu(fp8):
    args = list(_batch([300, 1, 77], [300, 900, 1077], heads=128, lat=512, rope=64, bs=16, dtype=torch.bfloat16))
    kw = {}
    if fp8:
        args[2] = (args[2].float() / 0.02).clamp(-448, 448).to(FP8_KV)
        kw = {"kv_scale": torch.tensor([0.02], device=DEV)}
    _close(mla.mla_paged_attention(*args, **kw), ref.mla_paged_attention(*args, **kw), 3e-2)
