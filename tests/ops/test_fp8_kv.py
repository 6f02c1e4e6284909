"""The fp8 KV cache paths of every implementation that declares them (turnout/ops/kv_cache.py), against the
reference, on each op's own conformance samples with the caches made float8_e4m3fn and per-tensor scales.

Here (CPU): vendor.cpu, reference.batch_invariant and the Triton kernels under TRITON_INTERPRET=1 (the
interpreter's fp32 -> fp8 cast is worked around in turnout/ops/triton/cache.py). Cache bytes written from the
same values are compared exactly; written from values an implementation computes itself (q/k norm, RoPE) within
one e4m3 step; attention outputs within the op's own tolerance (twice it where its keys were computed so).
Also: the dispatch under ``kv_cache=fp8`` skips what does not declare it, naming why, and the policy clause.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from turnout.ops import Policy, resolve
from turnout.ops.conformance import compare_tensors, interpreter_skip_reason, iter_cases, poisoned_allocations
from turnout.ops.kv_cache import FP8_KV, FP8_KV_OPS, handles_fp8
from turnout.ops.reference.cache import from_cache, to_cache
from turnout.ops.registry import default_registry
from turnout.ops.resolution import resolve_op
from turnout.platforms import detect_platform

FP8_POLICY = Policy.parse("kv_cache=fp8", source="test")
SCALES = (0.02, 0.05)  # k, v: randn values use most of e4m3's range (|x| / 0.02 up to ~250 of 448)
# each cache argument, the keyword of its scale, the scale (MLA's latent cache: one scale for the whole vector)
CACHES = (("k_cache", "k_scale", SCALES[0]), ("v_cache", "v_scale", SCALES[1]), ("latent_cache", "kv_scale", SCALES[0]))


def _fp8_case(spec, case, device):
    """The sample with its caches quantised (valid fp8 contents) and the scales added as keywords."""
    case = copy.deepcopy(case)
    names = list(inspect.signature(spec.reference).parameters)
    args = list(case.args)
    kwargs = {}
    for name, keyword, s in CACHES:
        if name in names:
            scale = torch.tensor([s], dtype=torch.float32, device=device)
            args[names.index(name)] = to_cache(args[names.index(name)], FP8_KV, scale)
            kwargs[keyword] = scale
    case.args = tuple(args)
    case.kwargs = {**case.kwargs, **kwargs}
    return case


def _close_after_rounding(ref: torch.Tensor, got: torch.Tensor, atol: float, rtol: float, scale: float) -> bool:
    """Cache values (dequantised) within the op's tolerance of the keys plus one e4m3 step (2^-3 relative,
    2^-9 x scale in the subnormals): what two implementations whose keys differ within tolerance store."""
    r, g = ref.float().cpu() * scale, got.float().cpu() * scale
    # NaN in both: a position the case poisoned (before a sliding window), which neither may touch
    return bool(((r - g).abs() <= atol + (rtol + 0.125) * r.abs() + 2.0 ** -9 * scale).logical_or(
        r.isnan() & g.isnan()).all())


def SCALE_ARGS(case):
    return case.kwargs["k_scale"], case.kwargs["v_scale"]


def _rows():
    registry, platform = default_registry(), detect_platform()
    rows, seen = [], set()
    for op in FP8_KV_OPS:
        for cand in resolve_op(op, registry, platform, FP8_POLICY).candidates:
            target = registry.get_impl(op, cand.impl).target  # one kernel registered twice is tested once
            if cand.impl != "reference.torch" and cand.available and (op, target) not in seen:
                seen.add((op, target))
                rows.append((op, cand.impl))
    return rows


@pytest.mark.parametrize("op,impl", _rows())
def test_fp8_cache_conformance(op, impl):
    registry, platform = default_registry(), detect_platform()
    spec = registry.ops[op]
    fn = resolve_op(op, registry, platform, FP8_POLICY).candidate(impl).fn
    mutates = [(n, s) for n, _, s in CACHES if n in spec.mutates]
    computed_keys = op == "rotary_paged_attention"  # keys it computes itself, then attends over
    failures, ran = [], 0
    for dtype, case in iter_cases(spec, platform.device()):
        case = _fp8_case(spec, case, platform.device())
        ref_case, got_case = copy.deepcopy(case), copy.deepcopy(case)
        with poisoned_allocations():
            ref_out = spec.reference(*ref_case.args, **ref_case.kwargs)
            try:
                got_out = fn(*got_case.args, **got_case.kwargs)
            except Exception as e:  # noqa: BLE001 - reported with the case
                failures.append(f"{dtype} {case.label}: raised {type(e).__name__}: {e}")
                continue
        ran += 1
        names = list(inspect.signature(spec.reference).parameters)
        arg = {n: i for i, n in enumerate(names)}
        atol, rtol = spec.tolerance[dtype]
        if op == "qk_norm_rotary_cache":  # its own normed, rotated key (written back in place) is what it stores
            want = copy.deepcopy(case)
            from turnout.ops.reference.cache import reshape_and_cache

            reshape_and_cache(got_case.args[arg["key"]], got_case.args[arg["value"]], want.args[arg["k_cache"]],
                              want.args[arg["v_cache"]], want.args[arg["slot_mapping"]], *SCALE_ARGS(want))
            ref_case = want
        for name, scale in mutates:
            r, g = ref_case.args[arg[name]], got_case.args[arg[name]]
            assert g.dtype == FP8_KV
            exact = torch.equal(r.view(torch.uint8), g.view(torch.uint8))
            if not exact and (op != "rotary_paged_attention" or not _close_after_rounding(r, g, atol, rtol, scale)):
                failures.append(f"{dtype} {case.label}: {name} bytes differ")
        if ref_out is not None:
            if computed_keys:
                atol, rtol = 2 * atol, 2 * rtol
            ok, err, msg = compare_tensors([ref_out], [got_out], atol, rtol)
            if not ok and not interpreter_skip_reason(fn, dtype):
                failures.append(f"{dtype} {case.label}: {msg}")
    assert ran, "no case ran"
    assert not failures, f"{op} {impl}:\n" + "\n".join(failures)


def test_fp8_attention_reads_the_scaled_values():
    """The reference's meaning: attention over an fp8 cache equals attention over the dequantised cache in the
    query's dtype; and the cache write is x / scale, clamped, rounded to nearest even."""
    registry = default_registry()
    spec = registry.ops["paged_attention"]
    gen = torch.Generator().manual_seed(1)
    case = next(iter(spec.sample_inputs("cpu", torch.float32, gen)))
    fp8 = _fp8_case(spec, case, "cpu")
    kc, vc = fp8.args[1], fp8.args[2]
    deq = (from_cache(kc, fp8.kwargs["k_scale"]), from_cache(vc, fp8.kwargs["v_scale"]))
    got = spec.reference(*fp8.args, **fp8.kwargs)
    want = spec.reference(fp8.args[0], *deq, *fp8.args[3:])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    x = torch.tensor([1.0, -1000.0, 0.0313, 9.0])
    s = torch.tensor([0.5])
    assert to_cache(x, FP8_KV, s).float().tolist() == [2.0, -448.0, 0.0625, 18.0]


def test_dispatch_skips_implementations_without_fp8_and_names_why():
    registry, platform = default_registry(), detect_platform()
    table = resolve(platform, FP8_POLICY, registry)
    assert "kv_cache=fp8" in table.policy.describe()
    for op in FP8_KV_OPS:
        res = table.resolutions[op]
        impl = registry.get_impl(op, res.chosen)
        assert handles_fp8(impl, platform)[0], (op, res.chosen)
        for c in res.candidates:
            other = registry.get_impl(op, c.impl)
            if other.serves(platform) and not handles_fp8(other, platform)[0]:
                assert not c.available and "fp8 KV cache" in c.reason, (op, c.impl, c.reason)
    # the invariant attention kernel declares no fp8: under both its batch-invariant twin in torch serves
    both = Policy.parse("invariant=all;kv_cache=fp8", source="test")
    res = resolve_op("paged_attention", registry, platform, both)
    assert res.chosen == "reference.batch_invariant"
    tri = res.candidate("triton.batch_invariant") if "triton.batch_invariant" in registry.impl_ids(
        "paged_attention") else None
    if tri is not None:
        assert not tri.available and "fp8 KV cache" in tri.reason
    # a vendor kernel that does not declare it is skipped, with the reason, and the next one serves
    from turnout.ops.spec import Impl

    fake = Impl(op="reshape_and_cache", id="vendor.nofp8", target=lambda *a, **k: None)
    assert handles_fp8(fake, platform) == (False, "does not handle an fp8 KV cache (kv_cache_dtype=fp8)")


def test_policy_clause():
    assert Policy.parse("kv_cache=fp8").kv_cache == "fp8"
    assert Policy.parse("").kv_cache == "auto"
    from turnout.ops.policy import PolicyError

    with pytest.raises(PolicyError, match="kv_cache"):
        Policy.parse("kv_cache=int4")


@pytest.mark.parametrize("q_scale", [3e4, 1e-5])
def test_fp8_attention_with_queries_beyond_float16(q_scale):
    """Over an fp8 cache the Triton kernel's dots are float16 (turnout/ops/triton/attention.py, F16_DOT): bfloat16
    queries far beyond float16's range (a scaled-down q, the scale divided back out of the scores) or far below its
    normal range give the reference's attention, in bfloat16's tolerance."""
    registry, platform = default_registry(), detect_platform()
    if not platform.triton_usable()[0]:
        pytest.skip("Triton does not run here")
    spec = registry.ops["paged_attention"]
    fn = resolve_op("paged_attention", registry, platform, FP8_POLICY).candidate("triton.default").fn
    gen = torch.Generator().manual_seed(3)
    case = _fp8_case(spec, next(iter(spec.sample_inputs(platform.device(), torch.bfloat16, gen))), platform.device())
    names = list(inspect.signature(spec.reference).parameters)
    args = list(case.args)
    args[names.index("query")] = (args[names.index("query")].float() * q_scale).to(torch.bfloat16)
    case.args = tuple(args)
    want = spec.reference(*copy.deepcopy(case.args), **copy.deepcopy(case.kwargs))
    got = fn(*copy.deepcopy(case.args), **copy.deepcopy(case.kwargs))
    assert torch.isfinite(got).all()
    atol, rtol = spec.tolerance["bfloat16"]
    ok, err, msg = compare_tensors([want], [got], atol, rtol)
    assert ok, msg
