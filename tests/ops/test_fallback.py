"""Fallback: a failing first call, in-place ops, strict mode, and (over the real registry) every
non-reference implementation removed in turn while every op still resolves, with the reason logged."""

import logging
import sys
import warnings

import pytest
import torch

from turnout.ops import (
    Impl,
    OpFailedError,
    OpSpec,
    OpUnavailableError,
    Policy,
    Registry,
    SampleCase,
    build_registry,
    dispatch,
    log_table,
    resolve,
)
from turnout.ops.spec import TRITON_PLATFORMS
from turnout.platforms import Platform

FAKE_CUDA = Platform(name="cuda", device_type="cpu", dist_backend="gloo", triton_backend=True)
NONE = Policy()


def scale_ref(x, factor):
    return x * factor


def add_ref(x, y):
    x.add_(y)


def _samples(device, dtype, gen):
    yield SampleCase("x", (torch.randn(4, generator=gen).to(device, dtype), 2.0))


class Counting:
    def __init__(self, fail=False, partial=False):
        self.calls, self.fail, self.partial = 0, fail, partial

    def __call__(self, x, arg):
        self.calls += 1
        if self.partial:
            x[:1] = -1  # wrote part of the output before failing
        if self.fail:
            raise RuntimeError("kernel launch failed: no kernel image for sm_90")
        return scale_ref(x, arg) if not isinstance(arg, torch.Tensor) else x.add_(arg)


def registry(*impls, inplace=False):
    reg = Registry()
    reg.add_op(OpSpec("scale", scale_ref, _samples))
    reg.add_op(OpSpec("add_", add_ref, _samples, mutates=("x",)))
    for i in impls:
        reg.add_impl(i)
    return reg


def test_functional_op_falls_back_with_a_warning(caplog):
    bad, good = Counting(fail=True), Counting()
    reg = registry(Impl("scale", "vendor.cuda", bad), Impl("scale", "triton.default", good))
    table = resolve(FAKE_CUDA, NONE, reg)
    assert table.chosen("scale") == "vendor.cuda"
    with caplog.at_level(logging.WARNING, logger="turnout.ops"), \
            pytest.warns(RuntimeWarning, match="vendor.cuda.*falling back to triton.default"):
        out = table.scale(torch.ones(3), 2.0)
    assert torch.equal(out, torch.full((3,), 2.0))
    assert bad.calls == 1 and good.calls == 1
    assert table.chosen("scale") == "triton.default"
    assert table.scale is good  # settled: no guard on later calls
    cand = table.resolutions["scale"].candidate("vendor.cuda")
    assert not cand.available and "failed on first use" in cand.reason and "sm_90" in cand.reason
    assert any("falling back to triton.default" in r.getMessage() for r in caplog.records)
    table.scale(torch.ones(3), 2.0)
    assert bad.calls == 1  # never called again


def test_fallback_chain_skips_unavailable_and_failing():
    bad1, bad2 = Counting(fail=True), Counting(fail=True)
    reg = registry(Impl("scale", "vendor.cuda", bad1), Impl("scale", "triton.default", bad2),
                   Impl("scale", "triton.other", Counting(), check=lambda p: (False, "nope"), priority=9))
    table = resolve(FAKE_CUDA, NONE, reg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table.scale(torch.ones(2), 3.0)
    assert table.chosen("scale") == "reference.torch" and table.scale is scale_ref


def test_inplace_op_falls_back_from_a_copy_of_what_it_writes(caplog):
    """A kernel that wrote part of its output and then raised: the arguments are put back as they were before
    the call, the next candidate runs on them, the op switches for good, and the log names the failed one."""
    bad, good = Counting(fail=True, partial=True), Counting()
    reg = registry(Impl("add_", "vendor.cuda", bad), Impl("add_", "triton.default", good))
    table = resolve(FAKE_CUDA, NONE, reg)
    x = torch.zeros(3)
    with caplog.at_level(logging.WARNING, logger="turnout.ops"), \
            pytest.warns(RuntimeWarning, match="vendor.cuda.*falling back to triton.default"):
        table.add_(x, torch.ones(3))
    assert torch.equal(x, torch.ones(3))  # not -1 + 1 in the element the failed kernel wrote
    assert bad.calls == 1 and good.calls == 1 and table.chosen("add_") == "triton.default"
    assert table.add_ is good
    assert sum("vendor.cuda" in r.getMessage() and "sm_90" in r.getMessage() for r in caplog.records) == 1
    y = torch.zeros(3)
    table.add_(y, torch.ones(3))
    assert torch.equal(y, torch.ones(3)) and bad.calls == 1


def test_inplace_op_too_large_to_copy_is_not_retried(monkeypatch):
    monkeypatch.setattr(dispatch, "SNAPSHOT_LIMIT_BYTES", 8)  # the 12 bytes of x are past it
    bad, good = Counting(fail=True, partial=True), Counting()
    reg = registry(Impl("add_", "vendor.cuda", bad), Impl("add_", "triton.default", good))
    table = resolve(FAKE_CUDA, NONE, reg)
    x = torch.zeros(3)
    with pytest.raises(OpFailedError) as e:
        table.add_(x, torch.ones(3))
    msg = str(e.value)
    for n in ("'add_'", "vendor.cuda", "platform cuda", "Not retried", "writes into x", "partly written",
              "too large", "deny=vendor.cuda", "sm_90"):
        assert n in msg, n
    assert good.calls == 0  # nobody ran on the half-written tensor
    assert x[0] == -1
    # The failure is sticky: a second call does not run the broken kernel again, nor a silent fallback.
    with pytest.raises(OpFailedError):
        table.add_(torch.zeros(3), torch.ones(3))
    assert bad.calls == 1 and good.calls == 0
    # Denying it, as the message says, uses the next candidate.
    table = resolve(FAKE_CUDA, Policy.parse("deny=vendor.cuda"), reg)
    y = torch.zeros(3)
    table.add_(y, torch.ones(3))
    assert torch.equal(y, torch.ones(3)) and table.chosen("add_") == "triton.default"


def test_inplace_op_under_strict_policy_is_not_retried():
    bad, good = Counting(fail=True, partial=True), Counting()
    reg = registry(Impl("add_", "vendor.cuda", bad), Impl("add_", "triton.default", good))
    table = resolve(FAKE_CUDA, Policy.parse("strict=1"), reg)
    with pytest.raises(OpFailedError, match="strict"):
        table.add_(torch.zeros(3), torch.ones(3))
    assert good.calls == 0


class Delegating:
    """Serves only float32 calls; hands the others to the ``fallback`` the resolution bound."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, factor, *, fallback):
        if x.dtype != torch.float32:
            return fallback(x, factor)
        self.calls += 1
        return x * factor


def test_delegating_implementation_gets_the_next_candidate_in_policy_order():
    mine, triton_impl = Delegating(), Counting()
    reg = registry(Impl("scale", "vendor.lib", mine, delegates=True),
                   Impl("scale", "vendor.cuda", Counting(), check=lambda p: (False, "no library")),
                   Impl("scale", "triton.default", triton_impl))
    table = resolve(FAKE_CUDA, NONE, reg)
    assert table.chosen("scale") == "vendor.lib"
    assert torch.equal(table.scale(torch.ones(2), 3.0), torch.full((2,), 3.0)) and mine.calls == 1
    half = table.scale(torch.ones(2, dtype=torch.float16), 3.0)  # not its shape: the next available candidate
    assert half.dtype == torch.float16 and torch.equal(half.float(), torch.full((2,), 3.0))
    assert mine.calls == 1 and triton_impl.calls == 1
    # Under a policy that orders the op, the fallback is what that order puts next: here the reference.
    table = resolve(FAKE_CUDA, Policy.parse("scale=vendor.lib|reference"), reg)
    table.scale(torch.ones(2), 1.0)
    table.scale(torch.ones(2, dtype=torch.float16), 3.0)
    assert triton_impl.calls == 1
    # Nothing after it: the call it cannot serve raises, naming it.
    table = resolve(FAKE_CUDA, Policy.parse("scale=vendor.lib;strict=1"), reg)
    table.scale(torch.ones(2), 1.0)
    with pytest.raises(NotImplementedError, match="vendor.lib cannot serve this call of scale"):
        table.scale(torch.ones(2, dtype=torch.float16), 3.0)


def test_strict_mode_raises_on_first_call_failure():
    bad, good = Counting(fail=True), Counting()
    reg = registry(Impl("scale", "vendor.cuda", bad), Impl("scale", "triton.default", good))
    table = resolve(FAKE_CUDA, Policy.parse("strict=1", source="TURNOUT_OPS"), reg)
    with pytest.raises(OpFailedError, match="strict.*TURNOUT_OPS.*no fallback.*sm_90"):
        table.scale(torch.ones(2), 2.0)
    assert good.calls == 0


def test_failure_with_nothing_left_names_the_op():
    reg = registry(Impl("scale", "vendor.cuda", Counting(fail=True)))
    table = resolve(FAKE_CUDA, Policy.parse("deny=reference,triton"), reg, ops=["scale"])
    with pytest.raises(OpUnavailableError, match="op 'scale'.*vendor.cuda.*no other implementation"):
        table.scale(torch.ones(2), 2.0)


# --- every non-reference implementation of the real registry, removed in turn -------------------

def _platform_for(impl) -> Platform:
    """A platform this implementation serves, with compiled Triton (tensors stay on CPU)."""
    names = [p for p in impl.platforms if p not in ("*", "cpu", TRITON_PLATFORMS)] or \
        (["cpu"] if "cpu" in impl.platforms else ["cuda"])
    return Platform(name=names[0], device_type="cpu", dist_backend="gloo", triton_backend=True)


def _non_reference_impls():
    reg = build_registry(plugins=False)
    return [(op, i.id) for op, impls in sorted(reg.impls.items()) for i in impls if i.family != "reference"]


@pytest.mark.parametrize("op,impl_id", _non_reference_impls())
def test_each_non_reference_impl_removed_every_op_still_resolves(op, impl_id, monkeypatch, caplog):
    reg = build_registry(plugins=False)
    impl = reg.get_impl(op, impl_id)
    if impl.module is None:
        # A callable target: remove the implementation from the registry instead.
        monkeypatch.setitem(reg.impls, op, [i for i in reg.impls[op] if i is not impl])
        needle = None
    else:
        # Its module fails to import, as a vendor library missing on this machine would.
        monkeypatch.setitem(sys.modules, impl.module, None)
        needle = f"import {impl.module} failed"
    platform = _platform_for(impl)
    table = resolve(platform, Policy.parse(f"prefer={impl.family}"), reg)  # it would be first in line
    assert set(table.resolutions) == set(reg.ops)
    assert all(table.chosen(o) for o in reg.ops if not reg.ops[o].optional)  # optional: the swap ops
    spec = reg.ops[op]
    if spec.requires is not None and not spec.requires(platform)[0]:  # the op itself cannot run here
        needle = None
    assert table.chosen(op) != impl_id
    if needle:
        cand = table.resolutions[op].candidate(impl_id)
        assert not cand.available and needle in cand.reason
        with caplog.at_level(logging.DEBUG, logger="turnout.ops"):
            log_table(table)
        info, debug = caplog.records[-2:]
        first = table.resolutions[op].candidates[0].impl == impl_id
        if first:  # first in line (prefer=its family, highest priority in it), so the op fell back past it
            assert f"past {impl_id} ({needle}" in info.getMessage() and op in info.getMessage()
        row = next(line for line in debug.getMessage().splitlines() if line.startswith(op + " "))
        assert f"{impl_id}: {needle}" in row
