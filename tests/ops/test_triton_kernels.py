"""Focused checks of the Triton kernels that the generic conformance cases do not reach.

CPU runs use the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) with small shapes; the
tests marked gpu use real model geometry in bfloat16 (Qwen3-8B attention: 32 query heads, 8 KV heads,
head_dim 128, block 16).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from turnout import envs
from turnout.ops.reference import attention as ref_attn
from turnout.ops.reference import cache as ref_cache
from turnout.ops.reference import norm as ref_norm
from turnout.ops.reference import rotary as ref_rotary
from turnout.ops.reference import sampling as ref_sampling
from turnout.ops.triton import attention, cache, norm, rotary, sampling

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _paged(qlens, kvlens, hq, hk, d, bs, dtype, device=DEV, seed=0):
    """A packed batch over a scattered paged cache, as the engine builds it."""
    g = torch.Generator().manual_seed(seed)
    b = len(qlens)
    max_blocks = max(triton_cdiv(k, bs) for k in kvlens)
    nb = b * max_blocks + 5
    k_cache = torch.randn((nb, bs, hk, d), generator=g).to(device, dtype)
    v_cache = torch.randn((nb, bs, hk, d), generator=g).to(device, dtype)
    tables = torch.randperm(nb, generator=g)[: b * max_blocks].view(b, max_blocks).to(device, torch.int32)
    query = torch.randn((sum(qlens), hq, d), generator=g).to(device, dtype)
    qsl = torch.tensor([0] + list(qlens)).cumsum(0).to(device, torch.int32)
    seq_lens = torch.tensor(kvlens, dtype=torch.int32, device=device)
    return (query, k_cache, v_cache, tables, seq_lens, qsl, max(qlens), max(kvlens), 1.0 / math.sqrt(d))


def triton_cdiv(a, b):
    return (a + b - 1) // b


def _close(got, want, atol, rtol):
    err = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol), f"max error {err:.3g}"


# ---------------------------------------------------------------------------------------------- attention

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 3e-3)])
def test_paged_attention_matches_sdpa_on_plain_causal_prefill(dtype, tol):
    hq, hk, d, bs, n = 4, 2, 32, 8, 37
    args = _paged([n], [n], hq, hk, d, bs, dtype)
    query, k_cache, v_cache, tables = args[:4]
    out = attention.paged_attention(*args)
    blocks = tables[0, : triton_cdiv(n, bs)].long()
    k = k_cache[blocks].reshape(-1, hk, d)[:n]
    v = v_cache[blocks].reshape(-1, hk, d)[:n]
    rep = hq // hk
    want = F.scaled_dot_product_attention(
        query.float().transpose(0, 1), k.float().repeat_interleave(rep, 1).transpose(0, 1),
        v.float().repeat_interleave(rep, 1).transpose(0, 1), is_causal=True, scale=1.0 / math.sqrt(d))
    _close(out, want.transpose(0, 1), tol, tol)


def test_split_kv_decode_long_context_small_batch():
    # Long contexts, two sequences: the heuristic splits; forcing other split counts must agree.
    args = _paged([1, 1], [1500, 700], 8, 2, 32, 16, torch.float32, seed=1)
    want = ref_attn.paged_attention(*args)
    assert attention.choose_num_splits(batch=2, kv_programs=2, max_query_len=1, max_seq_len=1500, num_sms=8) > 1
    _close(attention.paged_attention(*args), want, 2e-5, 2e-5)
    for splits in (1, 4, 9):
        _close(attention.paged_attention_impl(*args, num_splits=splits), want, 2e-5, 2e-5)


def test_split_kv_with_empty_splits_and_multi_token_queries():
    # A short sequence beside a long one leaves most of its splits empty; q_len 0 and 3 mixed in.
    args = _paged([3, 0, 1], [900, 4, 17], 4, 1, 32, 16, torch.float32, seed=2)
    _close(attention.paged_attention_impl(*args, num_splits=6), ref_attn.paged_attention(*args), 2e-5, 2e-5)


def test_split_merge_ignores_what_empty_splits_left_in_the_workspace(monkeypatch):
    """The merge loads every split's partial output with its log-sum-exp, unmasked, so every split program must
    write its rows, empty splits included (zeros, lse -inf): a workspace that starts as NaN must not leak
    into the output. One token per sequence (T == B), so the kernel takes its one-token path."""
    args = _paged([1, 1], [5, 300], 4, 1, 32, 16, torch.float32, seed=8)
    want = ref_attn.paged_attention(*args)
    real_empty = torch.empty

    def nan_empty(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    _close(attention.paged_attention_impl(*args, num_splits=8), want, 2e-5, 2e-5)


def test_split_heuristic_leaves_large_batches_alone():
    assert attention.choose_num_splits(64, 8, 1, 4096, 132) == 1  # 512 programs fill an H200
    assert attention.choose_num_splits(4, 8, 1, 4096, 132) > 1
    assert attention.choose_num_splits(4, 8, 7, 4096, 132) == 1  # prefill: never
    assert attention.choose_num_splits(1, 8, 1, 64, 132) == 1  # one KV tile: nothing to split
    assert attention.choose_num_splits(1, 8, 1, 200, 132) == 4  # batch 1: a split per 64-token tile
    assert attention.choose_num_splits(32, 8, 1, 4096, 132) == 1  # 256 programs: one per SM already


def test_split_count_fixed_for_a_graph_serves_short_and_long_contexts():
    # A captured graph fixes the split count from max_model_len; each sequence cuts its own context
    # into that many tile-aligned chunks: a 5-token context (one chunk, 15 empty splits), one just
    # over a tile, and a long one, in one batch.
    args = list(_paged([1, 1, 1], [5, 70, 1100], 8, 2, 32, 16, torch.float32, seed=3))
    want = ref_attn.paged_attention(*args)
    args[-2] = 4096  # max_seq_len as a graph captured at max_model_len 4096 passes it
    _close(attention.paged_attention_impl(*args, num_splits=16), want, 2e-5, 2e-5)


def test_split_count_from_the_tuning_env(monkeypatch):
    """TURNOUT_ATTN_DECODE fixes the decode split count (decode_step_ab.py compares counts in a captured step);
    a bad value is a ValueError naming the variable."""
    args = list(_paged([1, 1, 1], [5, 70, 1100], 8, 2, 32, 16, torch.float32, seed=4))
    want = ref_attn.paged_attention(*args)
    args[-2] = 4096
    for splits in (1, 3, 16):
        monkeypatch.setenv(attention.TUNING_ENV, f'{{"num_splits": {splits}}}')
        envs.reload()
        _close(attention.paged_attention_tuned()(*args), want, 2e-5, 2e-5)  # as the op table resolves it
    monkeypatch.setenv(attention.TUNING_ENV, '{"num_splits": 0}')
    with pytest.raises(ValueError, match="TURNOUT_ATTN_DECODE"):  # at start-up (turnout.envs)
        envs.reload()


def test_kv_tile_from_the_tuning_env(monkeypatch):
    """TURNOUT_ATTN_DECODE also sets the decode KV tile and launch parameters (one wide tile per split, as
    decode_step_ab.py compared on the H200); the result is the reference's, and bad values name the field."""
    args = list(_paged([1, 1, 1], [5, 70, 300], 8, 2, 32, 16, torch.float32, seed=5))
    want = ref_attn.paged_attention(*args)
    args[-2] = 512
    for setting in ('{"num_splits": 1, "block_n": 128, "num_warps": 8}', '{"num_splits": 2, "block_n": 32}',
                    '{"block_n": 256, "num_stages": 1}'):
        monkeypatch.setenv(attention.TUNING_ENV, setting)
        envs.reload()
        _close(attention.paged_attention_tuned()(*args), want, 2e-5, 2e-5)  # as the op table resolves it
    for bad, field in (('{"block_n": 48}', "block_n"), ('{"block_n": 8}', "block_n"), ('{"num_warps": 0}', "num_warps"),
                       ('{"num_stages": "2"}', "num_stages")):
        monkeypatch.setenv(attention.TUNING_ENV, bad)
        with pytest.raises(ValueError, match=f"TURNOUT_ATTN_DECODE.*{field}"):
            envs.reload()


def test_paged_attention_large_gqa_group_spans_head_tiles():
    # 96 query heads on one KV head: more than one head tile per KV head in decode.
    args = _paged([1, 2], [40, 33], 96, 1, 16, 16, torch.float32, seed=3)
    _close(attention.paged_attention(*args), ref_attn.paged_attention(*args), 2e-5, 2e-5)


def _rope_decode(kvlens, hq, hk, d, rot, neox, norm, bs, dtype, device=DEV, seed=0):
    """rotary_paged_attention arguments for one new token per sequence: raw q/k/v as views of one fused qkv,
    the new token's slot where the attention will read its position."""
    g = torch.Generator().manual_seed(seed)
    _, k_cache, v_cache, tables, seq_lens, qsl, _, max_kv, scale = _paged([1] * len(kvlens), kvlens, hq, hk, d, bs,
                                                                          dtype, device, seed)
    t = len(kvlens)
    qkv = torch.randn((t, (hq + 2 * hk) * d), generator=g).to(device, dtype)
    q, k, v = (qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d: (hq + hk) * d].view(t, hk, d),
               qkv[:, (hq + hk) * d:].view(t, hk, d))
    pos = torch.tensor([n - 1 for n in kvlens], device=device)
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(kvlens)],
                         device=device)
    qw = (torch.rand(d, generator=g) + 0.5).to(device, dtype) if norm else None
    kw = (torch.rand(d, generator=g) + 0.5).to(device, dtype) if norm else None
    cache = ref_rotary.make_cos_sin_cache(rot, max(kvlens) + 1).to(device)
    return (pos, q, k, v, qw, kw, 1e-6, cache, neox, k_cache, v_cache, slots, tables, seq_lens, qsl, 1, max_kv,
            scale)


def _check_rope_attention(args, num_splits, atol, rtol):
    k0, v0 = args[9].clone(), args[10].clone()
    want = ref_attn.rotary_paged_attention(*args)
    want_k, want_v = args[9].clone(), args[10].clone()
    args[9].copy_(k0)
    args[10].copy_(v0)
    pos, q, k, v, qw, kw, eps, cache, neox, kc, vc, slots, tables, seq_lens, qsl, mq, mkv, scale = args
    got = attention.paged_attention_impl(q, kc, vc, tables, seq_lens, qsl, mq, mkv, scale, num_splits=num_splits,
                                         rope=(pos, k, v, qw, kw, eps, cache, neox, slots))
    _close(got, want, atol, rtol)
    _close(kc, want_k, atol, rtol)
    _close(vc, want_v, atol, rtol)


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_rotary_paged_attention_every_split_count(splits):
    """The new token is written by the program whose KV range holds its position, whatever the split count
    (empty trailing splits included), before any program reads it; q/k norm, neox RoPE, GQA 4."""
    args = _rope_decode([70, 129, 5], 8, 2, 32, 32, True, True, 16, torch.float32, seed=splits)
    _check_rope_attention(args, splits, 2e-5, 2e-5)


def test_rotary_paged_attention_gptj_partial_rope_and_head_tiles():
    """Interleaved pairs on half the head, no norm, and 96 query heads on one KV head (two head tiles, which
    both write the same new k and v)."""
    args = _rope_decode([40, 33], 96, 1, 16, 8, False, False, 16, torch.float32, seed=7)
    _check_rope_attention(args, None, 2e-5, 2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 4, 16])
def test_gpu_rotary_paged_attention_qwen3_moe_shapes(splits):
    """Qwen3-30B-A3B geometry in bf16: 32 query heads, 4 KV heads, head_dim 128, q/k norm, full neox RoPE."""
    args = _rope_decode([200, 4096, 17, 1], 32, 4, 128, 128, True, True, 16, torch.bfloat16, device="cuda", seed=5)
    _check_rope_attention(args, splits, 3e-2, 2e-2)


# ---------------------------------------------------------------------------------------------- caches

def test_reshape_and_cache_from_strided_qkv_views():
    g = torch.Generator().manual_seed(0)
    t, hq, hk, d, nb, bs = 11, 4, 2, 32, 6, 8
    qkv = torch.randn((t, (hq + 2 * hk) * d), generator=g).to(DEV)
    key = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    value = qkv[:, (hq + hk) * d:].view(t, hk, d)
    slots = torch.randperm(nb * bs, generator=g)[:t].to(DEV)
    slots[3] = -1
    caches = [torch.randn((nb, bs, hk, d), generator=g).to(DEV) for _ in range(2)]
    want = [c.clone() for c in caches]
    cache.reshape_and_cache(key, value, *caches, slots)
    ref_cache.reshape_and_cache(key, value, *want, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


def test_copy_blocks_empty_mapping_is_a_no_op():
    c = torch.randn((4, 8, 2, 16), device=DEV)
    before = c.clone()
    cache.copy_blocks([c], torch.empty((0, 2), dtype=torch.int64, device=DEV))
    assert torch.equal(c, before)


# ---------------------------------------------------------------------------------------------- sampling

def _sample_args(logits, seeds, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    b = logits.shape[0]
    dev = logits.device
    return (logits, torch.full((b,), temperature, device=dev), torch.full((b,), top_k, dtype=torch.int32, device=dev),
            torch.full((b,), top_p, device=dev), torch.full((b,), min_p, device=dev), seeds.to(dev),
            torch.zeros(b, dtype=torch.int64, device=dev))


@pytest.mark.parametrize("top_k,top_p,min_p,expected", [
    (0, 1.0, 0.0, [0.1, 0.2, 0.3, 0.4]),
    (2, 1.0, 0.0, [0.0, 0.0, 3 / 7, 4 / 7]),
    (0, 0.6, 0.0, [0.0, 0.0, 3 / 7, 4 / 7]),  # 0.4 < 0.6, so 0.3 is kept; then 0.7 >= 0.6 stops
    (0, 1.0, 0.6, [0.0, 0.0, 3 / 7, 4 / 7]),  # 0.2 < 0.6 * 0.4
])
def test_sample_frequencies(top_k, top_p, min_p, expected):
    # The noise is a pure function of (seed, step, token), so the Triton kernel must draw exactly the
    # reference's tokens; the frequencies are then checked over many seeds (all of them on a GPU, a slice
    # under the interpreter, where each row is slow) and over far more seeds on the reference.
    n = 20000 if DEV == "cuda" else 120
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().repeat(20000, 1).to(DEV)
    args = _sample_args(logits, torch.arange(20000) * 7919 + 13, top_k=top_k, top_p=top_p, min_p=min_p)
    want = ref_sampling.sample(*args).cpu()
    got = sampling.sample(*(a[:n] for a in args)).cpu()
    assert torch.equal(got, want[:n])  # same noise, same tokens
    for tokens in (want, got):
        freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
        for f, p in zip(freq.tolist(), expected):
            sigma = math.sqrt(max(p * (1 - p), 1e-9) / len(tokens))
            assert abs(f - p) <= 4.5 * sigma + 1e-9, f"frequencies {freq.tolist()}, expected {expected}"


def test_sample_greedy_ties_take_the_lowest_id_across_chunks():
    v = 9000  # more than one BLOCK of the kernel
    logits = torch.zeros((3, v), device=DEV)
    logits[0, [5000, 7000]] = 3.0
    logits[1, [4095, 4096]] = 2.0
    logits[2, [8999]] = 1.0
    args = _sample_args(logits, torch.arange(3), temperature=0.0)
    assert sampling.sample(*args).tolist() == [5000, 4095, 8999]


def test_sample_matches_reference_with_tied_and_signed_zero_logits():
    g = torch.Generator().manual_seed(5)
    b, v = 12, 300
    logits = (torch.randn((b, v), generator=g) * 2).round()  # many ties
    logits[0] = 0.0
    logits[0, ::3] = -0.0
    args = (logits.to(DEV), torch.tensor([1.0, 0.5, 2.0] * 4, device=DEV),
            torch.tensor([0, 7, 40, 1, 299, 300] * 2, dtype=torch.int32, device=DEV),
            torch.tensor([1.0, 0.9, 0.3, 1.0, 0.05, 0.0] * 2, device=DEV),
            torch.tensor([0.0, 0.0, 0.1, 0.2, 0.0, 0.0] * 2, device=DEV),
            torch.randint(0, 2**62, (b,), generator=g).to(DEV), torch.arange(b, device=DEV) * 31)
    assert sampling.sample(*args).tolist() == ref_sampling.sample(*args).tolist()


# ---------------------------------------------------------------------------------------------- GPU, real shapes

@pytest.mark.gpu
@pytest.mark.parametrize("qlens,kvlens", [
    ([1] * 8, [4096, 1, 17, 333, 1024, 4095, 2048, 16]),  # decode, large batch-ish
    ([1, 1], [4096, 3000]),  # decode, small batch: split-KV
    ([512, 1, 77], [4096, 900, 77]),  # prefill over a prefix, decode, plain prefill
])
def test_gpu_paged_attention_bf16_real_shapes(qlens, kvlens):
    args = _paged(qlens, kvlens, 32, 8, 128, 16, torch.bfloat16, device="cuda")
    _close(attention.paged_attention(*args), ref_attn.paged_attention(*args), 2e-2, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 16, 64])
def test_gpu_paged_attention_forced_splits(splits):
    args = _paged([1] * 4, [4096, 2500, 100, 4000], 32, 8, 128, 16, torch.bfloat16, device="cuda", seed=4)
    _close(attention.paged_attention_impl(*args, num_splits=splits), ref_attn.paged_attention(*args), 2e-2, 2e-2)


@pytest.mark.gpu
def test_gpu_norm_rotary_cache_real_shapes():
    g = torch.Generator().manual_seed(0)
    t, h, hq, hk, d = 300, 4096, 32, 8, 128
    x = torch.randn((t, h), generator=g).cuda().bfloat16()
    w = (torch.randn(h, generator=g) * 0.1 + 1).cuda().bfloat16()
    _close(norm.rms_norm(x, w, 1e-6), ref_norm.rms_norm(x, w, 1e-6), 6e-2, 2e-2)
    qkv = torch.randn((t, (hq + 2 * hk) * d), generator=g).cuda().bfloat16()
    qkv_ref = qkv.clone()
    cs = ref_rotary.make_cos_sin_cache(d, 40960, 1e6).cuda()
    pos = torch.randint(0, 40960, (t,), generator=g).cuda()
    for buf, fn in ((qkv, rotary.rotary_embedding), (qkv_ref, ref_rotary.rotary_embedding)):
        fn(pos, buf[:, : hq * d].view(t, hq, d), buf[:, hq * d: (hq + hk) * d].view(t, hk, d), cs, True)
    _close(qkv, qkv_ref, 2e-2, 2e-2)
    nb, bs = 64, 16
    kc, vc = torch.zeros((nb, bs, hk, d), device="cuda", dtype=torch.bfloat16), torch.zeros(
        (nb, bs, hk, d), device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=g)[:t].cuda()
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    cache.reshape_and_cache(k, v, kc, vc, slots)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    ref_cache.reshape_and_cache(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 300])
def test_gpu_qk_norm_rotary_cache_real_shapes(t):
    """Qwen3-30B-A3B attention (32/4 heads, d 128) in bf16: q/k norm + RoPE in the fused qkv and the cache
    writes of one launch equal the reference's, padding slots included."""
    g = torch.Generator().manual_seed(t)
    hq, hk, d, nb, bs = 32, 4, 128, 64, 16
    qkv = torch.randn((t, (hq + 2 * hk) * d), generator=g).cuda().bfloat16()
    qw, kw = [(torch.randn(d, generator=g) * 0.1 + 1).cuda().bfloat16() for _ in range(2)]
    cs = ref_rotary.make_cos_sin_cache(d, 40960, 1e6).cuda()
    pos = torch.randint(0, 40960, (t,), generator=g).cuda()
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[::7] = -1
    outs = []
    for fn in (rotary.qk_norm_rotary_cache, ref_rotary.qk_norm_rotary_cache):
        buf = qkv.clone()
        kc, vc = torch.zeros((nb, bs, hk, d), device="cuda", dtype=torch.bfloat16), torch.zeros(
            (nb, bs, hk, d), device="cuda", dtype=torch.bfloat16)
        fn(pos, buf[:, : hq * d].view(t, hq, d), buf[:, hq * d: (hq + hk) * d].view(t, hk, d),
           buf[:, (hq + hk) * d:].view(t, hk, d), qw, kw, 1e-6, cs, True, kc, vc, slots.cuda())
        outs.append((buf, kc, vc))
    (buf, kc, vc), (rbuf, rkc, rvc) = outs
    _close(buf, rbuf, 6e-2, 2e-2)
    _close(kc, rkc, 6e-2, 2e-2)
    assert torch.equal(vc, rvc)


@pytest.mark.gpu
def test_gpu_swap_blocks_both_directions():
    g = torch.Generator().manual_seed(0)
    gpu = torch.randn((32, 16, 8, 128), generator=g).cuda().bfloat16()
    cpu = torch.randn((40, 16, 8, 128), generator=g).bfloat16()
    m = torch.stack([torch.randperm(32, generator=g)[:9], torch.randperm(40, generator=g)[:9]], 1)
    want = cpu.clone()
    ref_cache.swap_blocks(gpu, want, m)
    cache.swap_blocks(gpu, cpu, m)
    assert torch.equal(cpu, want)
    m2 = m.flip(1).cuda()  # the mapping may live on the GPU too
    want_gpu = gpu.clone()
    ref_cache.swap_blocks(cpu, want_gpu, m2)
    cache.swap_blocks(cpu, gpu, m2)
    assert torch.equal(gpu, want_gpu)


@pytest.mark.gpu
def test_gpu_sample_matches_reference_full_vocab():
    g = torch.Generator().manual_seed(0)
    b, v = 64, 151936
    logits = (torch.randn((b, v), generator=g) * 4).cuda()
    logits[::5] = logits[::5].bfloat16().float()  # bf16 logits upcast: many ties
    args = (logits, (torch.rand(b, generator=g) * 1.5).cuda(), torch.randint(0, 100, (b,), generator=g).int().cuda(),
            torch.rand(b, generator=g).clamp_min(0.3).cuda(), (torch.rand(b, generator=g) * 0.1).cuda(),
            torch.randint(0, 2**62, (b,), generator=g).cuda(), torch.randint(0, 4096, (b,), generator=g).cuda())
    args[1][::4] = 0.0
    got, want = sampling.sample(*args), ref_sampling.sample(*args)
    mismatches = (got != want).sum().item()
    assert mismatches == 0, f"{mismatches} of {b} rows differ"


@pytest.mark.parametrize("e,k", [(8, 2), (60, 4), (128, 8), (160, 8), (64, 6), (24, 3)])
def test_select_experts_ties_take_the_lower_id(e, k):
    """Logits on a coarse grid (many exact ties, also at the k-th place): the kernel's argmax rounds give the
    reference's ids and weights, which are a stable descending sort's."""
    from turnout.ops.reference import routing as ref_routing
    from turnout.ops.triton import routing

    g = torch.Generator().manual_seed(e)
    logits = (torch.randint(0, 4, (7, e), generator=g).float() / 2).to(DEV)
    args = (logits, k, "softmax", False, 1, 1, True, 1.0, None, None)
    want_w, want_ids = ref_routing.select_experts(*args)
    w, ids = routing.select_experts(*args)
    assert torch.equal(ids.long(), want_ids.long())
    _close(w, want_w, 1e-6, 1e-6)
