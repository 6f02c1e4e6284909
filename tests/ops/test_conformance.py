"""Every available non-reference implementation of every op, against the reference, on every sample case.

Parametrised at collection time from the live registry, so a new op or implementation is covered without
touching this file: one test per (op, implementation, dtype). Implementations that serve this platform but
cannot run here are reported as skips with the probe's reason. The policy is the plain default (not
``TURNOUT_OPS``), so an implementation denied for serving is still checked.
"""

from __future__ import annotations

import functools

import pytest

from turnout.ops import default_registry
from turnout.ops.conformance import interpreter_skip_reason, iter_cases, run_case
from turnout.ops.policy import Policy
from turnout.ops.resolution import resolve_op
from turnout.platforms import detect_platform


@functools.cache
def _resolved():
    """[(op, impl id, callable or None, reason)] for every non-reference implementation serving this platform."""
    registry, platform = default_registry(), detect_platform()
    rows = []
    for op in sorted(registry.ops):
        serving = {i.id for i in registry.impls[op] if i.serves(platform)}
        for cand in resolve_op(op, registry, platform, Policy()).candidates:
            if cand.impl == "reference.torch" or cand.impl not in serving:
                continue
            rows.append((op, cand.impl, cand.fn if cand.available else None, cand.reason))
    return registry, platform, rows


def _params():
    registry, platform, rows = _resolved()
    params = []
    for op in sorted(set(registry.ops) - {r[0] for r in rows}):  # visible in the report, not silently absent
        params.append(pytest.param(op, "-", "-", id=f"{op}-none", marks=pytest.mark.skip(
            reason=f"{op}: only the reference serves {platform.name}")))
    for op, impl, fn, reason in rows:
        for dtype in registry.ops[op].dtypes:
            marks = []
            if fn is None:
                marks.append(pytest.mark.skip(reason=f"{impl} unavailable on {platform.name}: {reason}"))
            params.append(pytest.param(op, impl, dtype, id=f"{op}-{impl}-{dtype}", marks=marks))
    return params


@pytest.mark.parametrize("op,impl,dtype", _params())
def test_conformance(op, impl, dtype, record_property):
    registry, platform, rows = _resolved()
    fn = next(f for o, i, f, _ in rows if o == op and i == impl)
    spec = registry.ops[op]
    failures, worst, ran = [], 0.0, 0
    for case_dtype, case in iter_cases(spec, platform.device()):
        if case_dtype != dtype:
            continue
        ok, err, msg = run_case(spec, fn, case, dtype)
        ran += 1
        worst = max(worst, err) if err == err else float("nan")
        if not ok:
            failures.append(f"{case.label}: {msg} (max error {err:.3g})")
    record_property("max_error", worst)
    print(f"{op} {impl} {dtype}: {ran} cases, max error {worst:.3g}")
    assert ran, f"op {op} has no sample case for {dtype}"
    skip = interpreter_skip_reason(fn, dtype) if failures else ""
    if skip:  # `turnout ops --check` reports these as SKIP too (the interpreter is wrong, not the kernel)
        pytest.skip(f"{len(failures)} case(s) failed, but {skip}")
    assert not failures, f"{op} {impl} {dtype} on {platform.name}:\n" + "\n".join(failures)

