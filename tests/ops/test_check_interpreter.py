"""`turnout ops --check` under TRITON_INTERPRET=1: a bfloat16 case of a kernel that calls tl.dot, which
fails because the interpreter's own bfloat16 tl.dot is wrong, is a SKIP with that reason; every other
failure stays a FAIL."""

import io
import json

import pytest
import torch

from turnout import envs
from turnout.ops import Impl, build_registry, conformance, doctor
from turnout.ops.triton import attention, norm

interpreted = pytest.mark.skipif(not envs.get().triton_interpret, reason="needs TRITON_INTERPRET=1 (CPU)")


def _check(registry, op):
    out = io.StringIO()
    rc = doctor.main(check=True, device="cpu", ops=[op], out=out, registry=registry)
    text = out.getvalue()
    out = io.StringIO()
    doctor.main(check=True, as_json=True, device="cpu", ops=[op], out=out, registry=registry)
    return rc, text, {r["impl"]: r for r in json.loads(out.getvalue())}


def test_which_kernels_call_tl_dot():
    assert conformance.uses_tl_dot(attention.paged_attention)
    assert not conformance.uses_tl_dot(norm.rms_norm)
    from turnout.ops.triton import moe

    assert conformance.uses_tl_dot(moe.moe_experts)


@interpreted
def test_interpreter_bf16_dot_is_skip_with_the_reason():
    err = conformance.interpreter_bf16_dot_error()
    assert err is not None
    if err <= 0.1:
        pytest.skip(f"this Triton's interpreter gets a bfloat16 tl.dot right (error {err})")
    rc, text, rows = _check(build_registry(plugins=False), "paged_attention")
    assert rc == 0, text
    row = rows["triton.default"]
    assert row["passed"] and row["failed"] == 0 and row["skipped"] > 0
    assert all(s.startswith("bfloat16 ") for s in row["skips"])
    assert "bfloat16" not in row["max_error_by_dtype"]  # the interpreter's garbage is no max error
    line = next(line for line in text.splitlines() if "triton.default" in line and "SKIP" in line)
    assert "bfloat16 case(s): the Triton interpreter's bfloat16 tl.dot is wrong" in line
    assert "FAIL" not in text


@interpreted
def test_the_same_failure_is_a_fail_when_the_interpreter_is_right(monkeypatch):
    monkeypatch.setattr(conformance, "interpreter_bf16_dot_error", lambda: 0.0)
    rc, text, rows = _check(build_registry(plugins=False), "paged_attention")
    assert rc == 1
    assert not rows["triton.default"]["passed"] and rows["triton.default"]["skipped"] == 0
    assert "FAIL" in text


def test_real_bf16_failure_without_tl_dot_stays_fail():
    def wrong_in_bf16(x):
        d = x.shape[-1] // 2
        out = torch.nn.functional.silu(x[..., :d]) * x[..., d:]
        return out + 1.0 if x.dtype == torch.bfloat16 else out

    registry = build_registry(plugins=False)
    registry.add_impl(Impl("silu_and_mul", "vendor.testchip", wrong_in_bf16, platforms=("cpu",)))
    rc, text, rows = _check(registry, "silu_and_mul")
    assert rc == 1
    row = rows["vendor.testchip"]
    assert not row["passed"] and row["skipped"] == 0 and row["failed"] > 0
    assert all(f.startswith("bfloat16 ") for f in row["failures"])


def test_float32_failure_of_a_tl_dot_kernel_stays_fail():
    def off(*args):  # the Triton kernel (it calls tl.dot), wrong in every dtype
        return attention.paged_attention(*args) + 1.0

    registry = build_registry(plugins=False)
    registry.add_impl(Impl("paged_attention", "vendor.testchip", off, platforms=("cpu",)))
    rc, text, rows = _check(registry, "paged_attention")
    assert rc == 1
    failed = rows["vendor.testchip"]["failures"]
    assert any(f.startswith("float32 ") for f in failed) and any(f.startswith("float16 ") for f in failed)
