"""Both Triton paths of ``moe_experts_biased`` (the op's declared choice ``kernel``): the sort-free decode kernels
and the sorted grouped GEMM, each forced over every conformance case (the suite itself runs ``auto``, which sends
these small cases to the decode kernels), plus batches that ``auto`` sends to the grouped path; float32 and
float16 under the interpreter on CPU (its bfloat16 tl.dot is wrong). A kernel that drops a bias, or computes plain
SwiGLU for the clamped unit, fails the float32 cases (checked below)."""

from __future__ import annotations

import functools

import pytest
import torch

from turnout.ops import default_registry
from turnout.ops.conformance import iter_cases, run_case
from turnout.ops.reference._util import randn
from turnout.ops.reference.moe import _routing
from turnout.ops.spec import SampleCase
from turnout.platforms.detect import detect_platform

SPEC = default_registry().ops["moe_experts_biased"]


def _triton():
    if not detect_platform("cpu").triton_usable()[0]:
        pytest.skip("Triton does not run here")
    from turnout.ops.triton.moe_biased import moe_experts_biased

    return moe_experts_biased


def _large_cases(dtype, gen):
    """Batches past the decode threshold (T*k > max(128, 4E)): ``auto`` takes the grouped GEMM."""
    for t, h, i, e, k in ((80, 32, 48, 8, 2), (40, 64, 32, 4, 4)):
        w, ids = _routing(t, e, k, "cpu", gen)
        yield SampleCase(f"large_T{t}E{e}k{k}", (randn((t, h), dtype, "cpu", gen, 2.0),
                                                 randn((e, 2 * i, h), dtype, "cpu", gen, 3.0 * h ** -0.5),
                                                 randn((e, 2 * i), dtype, "cpu", gen, 2.0),
                                                 randn((e, h, i), dtype, "cpu", gen, 0.05 * i ** -0.5),
                                                 randn((e, h), dtype, "cpu", gen), w, ids),
                         {"activation": "clamped_swiglu", "alpha": 1.702, "limit": 7.0})


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernel", ["grouped", "decode", "auto"])
def test_each_path_matches_the_reference(kernel, dtype):
    fn = functools.partial(_triton(), kernel=kernel)
    cases = [c for d, c in iter_cases(SPEC, "cpu") if d == dtype]
    cases += list(_large_cases(getattr(torch, dtype), torch.Generator().manual_seed(1)))
    failures = [f"{c.label}: {msg}" for c in cases for ok, _, msg in [run_case(SPEC, fn, c, dtype)] if not ok]
    assert not failures, failures


@pytest.mark.parametrize("kernel", ["grouped", "decode"])
def test_a_kernel_that_computes_something_else_fails(kernel):
    """The cases can tell: without the down bias, or with plain SwiGLU instead of the clamped unit, the float32
    cases fail."""
    fn = _triton()
    cases = [c for d, c in iter_cases(SPEC, "cpu") if d == "float32" and c.kwargs.get("activation") == "clamped_swiglu"
             and c.args[4] is not None][:2]

    def no_down_bias(h, w13, b13, w2, b2, *rest, **kw):
        return fn(h, w13, b13, w2, None, *rest, kernel=kernel, **kw)

    def plain_swiglu(*args, **kw):
        return fn(*args, **{**kw, "activation": "silu"}, kernel=kernel)

    for wrong in (no_down_bias, plain_swiglu):
        assert all(not run_case(SPEC, wrong, c, "float32")[0] for c in cases), wrong.__name__
