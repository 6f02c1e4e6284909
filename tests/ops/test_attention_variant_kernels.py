"""The Triton attention kernels with the variants, where the generic conformance cases do not reach: decode over a
long context with a short window (the loop starts at the window; blocks before it are poison and may even be
absent from the table), forced split counts, the fused rotary decode, the decode tiles bound once, and the same
conformance cases on a GPU.

CPU runs use the Triton interpreter (tests/conftest.py) in float32 / float16.
"""

from __future__ import annotations

import math

import pytest
import torch

from turnout import envs
from turnout.ops import default_registry
from turnout.ops.conformance import iter_cases, run_case
from turnout.ops.dispatch import resolve
from turnout.ops.policy import Policy
from turnout.ops.reference import attention as ref_attn
from turnout.ops.reference.attention_variants import window_start
from turnout.ops.triton import attention
from turnout.platforms import detect_platform

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _long_decode(kvlens, window, hq=4, hk=2, d=32, bs=16, dtype=torch.float32, seed=0):
    """Decode over long contexts whose blocks before the window are NaN, and whose table entries there point at a
    NaN block (as a freed and reused block might): only the window may be read."""
    g = torch.Generator().manual_seed(seed)
    b = len(kvlens)
    max_blocks = max(-(-n // bs) for n in kvlens)
    nb = b * max_blocks + 1
    k_cache = torch.randn(nb, bs, hk, d, generator=g).to(DEV, dtype)
    v_cache = torch.randn(nb, bs, hk, d, generator=g).to(DEV, dtype)
    tables = torch.randperm(nb - 1, generator=g)[: b * max_blocks].view(b, max_blocks)
    poison = nb - 1
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    for s, n in enumerate(kvlens):
        lo = window_start(n - 1, window)
        ref_attn.poison_before_window(k_cache, v_cache, tables[s:s + 1], [1], [n], window)
        tables[s, : lo // bs] = poison
    query = torch.randn(b, hq, d, generator=g).to(DEV, dtype)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=DEV)
    return (query, k_cache, v_cache, tables.to(DEV, torch.int32), torch.tensor(kvlens, dtype=torch.int32, device=DEV),
            qsl, 1, max(kvlens), 1.0 / math.sqrt(d))


@pytest.mark.parametrize("splits", [None, 1, 3, 8])
def test_windowed_decode_reads_only_the_window(splits):
    args = _long_decode([700, 40, 333], window=48)
    kw = dict(sliding_window=48, logit_softcap=6.0, sinks=torch.linspace(-1.0, 2.0, 4, device=DEV))
    want = ref_attn.paged_attention(*args, **kw)
    got = attention.paged_attention_impl(*args, num_splits=splits, **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_fused_rotary_decode_with_variants_over_poisoned_blocks():
    """rotary_paged_attention at decode (one kernel: norm, RoPE, cache write, attention) with every variant."""
    from turnout.ops.reference.rotary import make_cos_sin_cache

    args = list(_long_decode([300, 77], window=20, hq=4, hk=2, d=48, bs=8, seed=2))
    query, k_cache, v_cache, tables, seq_lens = args[:5]
    g = torch.Generator().manual_seed(5)
    key = torch.randn(2, 2, 48, generator=g).to(DEV)
    value = torch.randn(2, 2, 48, generator=g).to(DEV)
    pos = (seq_lens - 1).long()
    slots = torch.stack([tables[b, pos[b] // 8].long() * 8 + pos[b] % 8 for b in range(2)])
    qw, kw_ = torch.rand(48, generator=g).to(DEV) + 0.5, torch.rand(48, generator=g).to(DEV) + 0.5
    cache = make_cos_sin_cache(48, 400).to(DEV)
    kw = dict(sliding_window=20, logit_softcap=3.0, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEV))
    for splits in (None, 1, 4):
        ref_caches, got_caches = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
        want = ref_attn.rotary_paged_attention(pos, query, key, value, qw, kw_, 1e-6, cache, True, *ref_caches, slots,
                                               *args[3:], **kw)
        got = attention.rotary_paged_attention(pos, query, key, value, qw, kw_, 1e-6, cache, True, *got_caches, slots,
                                               *args[3:], num_splits=splits, **kw)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        for r, c in zip(ref_caches, got_caches):
            torch.testing.assert_close(c, r, atol=1e-6, rtol=1e-6, equal_nan=True)


def test_decode_tiles_are_bound_when_the_table_is_resolved(monkeypatch):
    """TURNOUT_ATTN_DECODE is read once, when the op table is resolved; a launch never reads it."""
    seen = []
    real = attention.paged_attention_impl
    monkeypatch.setattr(attention, "paged_attention_impl",
                        lambda *a, **kw: seen.append(kw["decode_tuning"]) or real(*a, **kw))
    platform = detect_platform()
    policy = Policy.from_sources("paged_attention=triton", platform=platform, env={})
    monkeypatch.setenv(attention.TUNING_ENV, '{"num_splits": 2, "block_n": 32}')
    envs.reload()
    tuned = resolve(platform, policy, default_registry(), ops=["paged_attention"])
    monkeypatch.delenv(attention.TUNING_ENV)
    envs.reload()
    plain = resolve(platform, policy, default_registry(), ops=["paged_attention"])
    monkeypatch.setenv(attention.TUNING_ENV, '{"num_splits": 5}')  # after resolution: changes nothing
    envs.reload()
    args = _long_decode([90, 33], window=None)
    want = ref_attn.paged_attention(*args)
    torch.testing.assert_close(tuned.paged_attention(*args), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(plain.paged_attention(*args), want, atol=2e-5, rtol=2e-5)
    assert seen == [{"num_splits": 2, "block_n": 32}, {}]


_OPS = ("paged_attention", "rotary_paged_attention")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", _OPS)
def test_gpu_conformance_of_every_attention_implementation(op, dtype):
    """The conformance cases (variants, head dims, poisoned out-of-window blocks) on CUDA, for every implementation
    of the op that serves the GPU (the Triton kernels, batch-invariant ones included)."""
    registry = default_registry()
    platform = detect_platform()
    spec = registry.ops[op]
    failures, ran = [], 0
    for impl in registry.impls[op]:
        ok, why, fn = impl.probe(platform)
        if not ok or impl.id == "reference.torch":
            continue
        for case_dtype, case in iter_cases(spec, platform.device()):
            if case_dtype != dtype:
                continue
            ok, err, msg = run_case(spec, fn, case, dtype, platform)
            ran += 1
            if not ok:
                failures.append(f"{impl.id} {case.label}: {msg}")
    assert ran and not failures, "\n".join(failures)
