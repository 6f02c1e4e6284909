"""The decompressed latent prefill's Triton kernels (turnout/ops/triton/mla_prefill.py) beyond the conformance
cases: query tiles of both sizes against the reference, keys past each sequence's causal limit holding NaN (never
read), and the decompressed form equal to the absorbed op on the same latent cache (what the layer relies on).
CPU: the Triton interpreter, float32; the gpu-marked cases run DeepSeek-V3's shape in bfloat16 (and an fp8 cache)."""

from __future__ import annotations

import pytest
import torch

from turnout.ops.kv_cache import FP8_KV
from turnout.ops.reference import mla as ref_mla
from turnout.ops.reference import mla_prefill as ref
from turnout.ops.reference.cache import to_cache
from turnout.ops.triton import mla_prefill

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _close(got, want, tol):
    err = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), f"max error {err:.3g}"


@pytest.mark.parametrize("tiles", [{"block_m": 16, "block_n": 16}, {"block_m": 64, "block_n": 32}])
def test_varlen_tiles_match_the_reference_and_never_read_past_the_keys(tiles):
    gen = torch.Generator().manual_seed(0)
    q, key, value, qsl, ksl, mq, mk, scale = ref.varlen_batch([40, 1, 17], [40, 30, 50], 3, 24, 16, torch.float32,
                                                              DEV, gen)
    want = ref.varlen_attention(q, key, value, qsl, ksl, mq, mk, scale)
    # rows past the last sequence's keys hold NaN: a tile reading past its sequence would bring them in
    nan = torch.full((20,) + key.shape[1:], float("nan"), device=DEV)
    key_p, value_p = torch.cat([key, nan]), torch.cat([value, nan[..., :16]])
    got = mla_prefill.varlen_attention(q, key_p, value_p, qsl, ksl, mq, mk, scale, tiles=tiles)
    assert not got.isnan().any()
    _close(got, want, 2e-5)


def test_decompressed_equals_absorbed_on_one_latent_cache():
    """k_nope = W_UK c, v = W_UV c out of the gathered cache, attention over them, equals the absorbed op's
    latent output taken back through W_UV (the two paths of the layer), on a scattered paged cache."""
    gen = torch.Generator().manual_seed(3)
    heads, lat, rope, nope, vd = 3, 32, 16, 16, 24
    q_lat, q_pe, cache, tables, seq_lens, qsl, mq, ms, scale = ref_mla.paged_batch(
        [7, 12], [25, 12], heads, lat, rope, 8, torch.float32, DEV, gen)
    w_uk = torch.randn(heads, nope, lat, generator=gen).to(DEV) * lat ** -0.5
    w_uv = torch.randn(heads, vd, lat, generator=gen).to(DEV) * lat ** -0.5
    q_nope = torch.randn(q_lat.shape[0], heads, nope, generator=gen).to(DEV)
    q_lat = torch.einsum("thn,hnl->thl", q_nope, w_uk)
    o_lat = ref_mla.mla_paged_attention(q_lat, q_pe, cache, tables, seq_lens, qsl, mq, ms, scale)
    want = torch.einsum("thl,hvl->thv", o_lat, w_uv)
    ksl = torch.tensor([0, 25, 37], dtype=torch.int32, device=DEV)
    rows = mla_prefill.mla_gather_cache(cache, tables, seq_lens, ksl, ms, 37, torch.float32)
    c, k_pe = rows[:, :lat], rows[:, lat:]
    key = torch.cat([torch.einsum("sl,hnl->shn", c, w_uk), k_pe[:, None].expand(37, heads, rope)], dim=-1)
    value = torch.einsum("sl,hvl->shv", c, w_uv)
    got = mla_prefill.varlen_attention(torch.cat([q_nope, q_pe], -1), key, value, qsl, ksl, mq, ms, scale)
    _close(got, want, 2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fp8", [False, True])
def test_deepseek_v3_shape_bf16_on_gpu(fp8):
    gen = torch.Generator().manual_seed(0)
    args = ref.varlen_batch([700, 64, 1], [700, 3000, 9], 16, 192, 128, torch.bfloat16, DEV, gen)
    _close(mla_prefill.varlen_attention(*args), ref.varlen_attention(*args), 3e-2)
    _, _, cache, tables, seq_lens, _, _, ms, _ = ref_mla.paged_batch([1, 1], [700, 3000], 1, 512, 64, 16,
                                                                        torch.bfloat16, DEV, gen)
    kw = {}
    if fp8:
        kw = {"kv_scale": torch.tensor([0.02], device=DEV)}
        cache = to_cache(cache, FP8_KV, kw["kv_scale"])
    ksl = torch.tensor([0, 700, 3700], dtype=torch.int32, device=DEV)
    want = ref.mla_gather_cache(cache, tables, seq_lens, ksl, ms, 3700, torch.bfloat16, **kw)
    assert torch.equal(mla_prefill.mla_gather_cache(cache, tables, seq_lens, ksl, ms, 3700, torch.bfloat16, **kw), want)
