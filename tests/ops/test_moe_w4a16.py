"""moe_experts_w4a16: the reference is the float moe_experts on the dequantised experts; vendor.cpu and the Triton
grouped kernel (TRITON_INTERPRET=1 on CPU, float32 and float16: the interpreter's bfloat16 dot is wrong) equal it on
shapes with zero points and without, activation order, groups of 32 to 128, several rows per block and remote
experts; stacks that disagree are refused naming the tensor."""

from __future__ import annotations

import pytest
import torch

from turnout.ops.reference import moe as float_moe
from turnout.ops.reference import moe_w4a16 as ref
from turnout.ops.reference.moe import _routing
from turnout.ops.vendors.cpu import moe_w4a16 as cpu


def _case(t, h, i, e, k, g, zeros, perm, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    stacks = ref.random_experts(e, h, i, g, dtype, "cpu", gen, zeros)
    weights, ids = _routing(t, e, k, "cpu", gen)
    perms = (ref._perms(e, h, "cpu", gen), ref._perms(e, i, "cpu", gen)) if perm else (None, None)
    x = (torch.randn(t, h, generator=gen) * 0.5).to(dtype)
    return (x, *stacks, weights, ids, g, *perms)


def test_reference_is_the_float_op_on_the_dequantised_experts():
    args = _case(9, 128, 64, 4, 2, 32, True, True, torch.float32)
    x, q13, s13, q2, s2, w, ids, g, p13, p2 = args
    w13 = torch.stack([ref.dequantize_expert(q13[e], s13[e], g, p13[e]) for e in range(4)])
    w2 = torch.stack([ref.dequantize_expert(q2[e], s2[e], g, p2[e]) for e in range(4)])
    torch.testing.assert_close(ref.moe_experts_w4a16(*args), float_moe.moe_experts(x, w13, w2, w, ids),
                               atol=1e-5, rtol=1e-5)


def _impls():
    out = [pytest.param(cpu.moe_experts_w4a16, id="vendor.cpu")]
    from turnout.ops.triton._tuning import interpreted

    if interpreted():
        from turnout.ops.triton import moe_w4a16 as tri

        out.append(pytest.param(tri.moe_experts_w4a16, id="triton"))
    return out


@pytest.mark.parametrize("fn", _impls())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("t,h,i,e,k,g,zeros,perm", [(1, 64, 64, 4, 2, 64, True, False),
                                                    (12, 128, 128, 4, 2, 32, True, True),
                                                    (4, 128, 128, 8, 2, 128, False, False)])
def test_paths_equal_reference(fn, dtype, t, h, i, e, k, g, zeros, perm):
    args = _case(t, h, i, e, k, g, zeros, perm, dtype, seed=t + h)
    want = ref.moe_experts_w4a16(*args)
    tol = 3e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fn(*args).float(), want.float(), atol=tol, rtol=tol)


def test_triton_rows_per_program_do_not_change_the_result():
    """BLOCK_M 16 (decode-sized) and 64 (prefill): padding rows, several experts a launch, the same sums."""
    from turnout.ops.triton._tuning import interpreted

    if not interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (CPU)")
    from turnout.ops.triton import moe_w4a16 as tri

    args = _case(20, 64, 64, 4, 2, 32, True, True, torch.float16, seed=3)
    want = ref.moe_experts_w4a16(*args).float()
    for bm in (16, 64):
        torch.testing.assert_close(tri.moe_experts_w4a16(*args, block_m=bm).float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("fn", [ref.moe_experts_w4a16] + [p.values[0] for p in _impls()[:2]])
def test_bad_stacks_refused(fn):
    x, q13, s13, q2, s2, w, ids, g, _, _ = _case(3, 64, 64, 4, 2, 32, True, False, torch.float32)
    with pytest.raises(ValueError, match="w13_qweight: scale_zeros .* disagrees"):
        fn(x, q13, s13[:, :1], q2, s2, w, ids, g)
    with pytest.raises(ValueError, match="w2_qweight: scale_zeros .* disagrees"):
        fn(x, q13, s13, q2, s2[:, :, :32], w, ids, g)
    with pytest.raises(ValueError, match="w2_scale_zeros: 3 experts"):
        fn(x, q13, s13, q2, s2[:3], w, ids, g)
    with pytest.raises(ValueError, match="whole blocks of 64 rows"):
        fn(x, q13[:, :96], s13[:, :, :96], q2, s2, w, ids, g)
    with pytest.raises(ValueError, match=r"w13_perm \(4, 32\) must be \[4, 64\]"):
        fn(x, q13, s13, q2, s2, w, ids, g, torch.zeros(4, 32, dtype=torch.int64), None)
