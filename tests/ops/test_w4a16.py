"""w4a16_linear: the packed layout is torch's int4 CPU layout, every implementation equals the reference on the
shapes that pick each of its paths, and a packed weight that disagrees with its scales is refused naming it."""

from __future__ import annotations

import pytest
import torch

from turnout.ops.reference import w4a16 as ref
from turnout.ops.vendors.cpu import w4a16 as cpu


@pytest.mark.parametrize("n,k", [(64, 64), (192, 576), (128, 32)])
def test_pack_is_torch_int4_cpu_layout(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = ref.pack_int4(q)
    if hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
    assert torch.equal(ref.unpack_int4(packed).int(), q)


def test_dequantized_value_is_the_contract():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 64), generator=gen)
    scale, zero = torch.rand(2, 64) + 0.1, torch.randn(2, 64)
    sz = torch.stack((scale, zero), dim=2)
    w = ref.dequantize_w4(ref.pack_int4(q), sz, 32)
    want = (q.float() - 8) * scale.T.repeat_interleave(32, dim=1) + zero.T.repeat_interleave(32, dim=1)
    assert torch.equal(w, want)


def test_act_perm_reads_input_columns():
    gen = torch.Generator().manual_seed(1)
    qw, sz = ref.random_w4(64, 64, 32, torch.float32, "cpu", gen)
    perm = torch.randperm(64, generator=gen)
    x = torch.randn(2, 64, generator=gen)
    w = ref.dequantize_w4(qw, sz, 32)
    assert torch.allclose(ref.w4a16_linear(x, qw, sz, 32, perm), x[:, perm] @ w.T, atol=1e-5)


def _native():
    from turnout.ops.spec import ImplUnavailable
    from turnout.ops.vendors.cpu import native

    try:
        return native.w4a16_linear_factory()
    except ImplUnavailable as e:  # no compiler here: the conformance report names it too
        pytest.skip(f"vendor.cpu_native unavailable: {e}")


def _impls():
    out = [pytest.param(cpu.w4a16_linear, id="vendor.cpu"), pytest.param(_native, id="vendor.cpu_native")]
    from turnout.ops.triton._tuning import interpreted

    if interpreted():
        from turnout.ops.triton import w4a16 as tri

        out.append(pytest.param(tri.w4a16_linear, id="triton"))
    return out


@pytest.mark.parametrize("fn", _impls())
@pytest.mark.parametrize("m,n,k,g", [(1, 64, 64, 64), (1, 256, 1024, 128), (2, 64, 256, 32), (20, 128, 128, 32),
                                     (129, 128, 64, 32), (0, 64, 64, 32)])
def test_paths_equal_reference(fn, m, n, k, g):
    fn = fn() if fn is _native else fn
    gen = torch.Generator().manual_seed(m + n + k)
    qw, sz = ref.random_w4(n, k, g, torch.float32, "cpu", gen)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen)
    torch.testing.assert_close(fn(x, qw, sz, g, None, b), ref.w4a16_linear(x, qw, sz, g, None, b),
                               atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("fn", [ref.w4a16_linear] + [p.values[0] for p in _impls()])
def test_bad_shapes_refused(fn):
    fn = fn() if fn is _native else fn
    gen = torch.Generator().manual_seed(0)
    qw, sz = ref.random_w4(64, 128, 32, torch.float32, "cpu", gen)
    x = torch.randn(1, 128)
    with pytest.raises(ValueError, match="scale_zeros .* disagrees"):
        fn(x, qw, sz[:2], 32)
    with pytest.raises(ValueError, match="group size 16"):
        fn(x, qw, sz, 16)
    with pytest.raises(ValueError, match="N a multiple of 64"):
        fn(x, qw[:32], sz[:, :32], 32)
    with pytest.raises(ValueError, match="K = 256"):
        fn(torch.randn(1, 256), qw, sz, 32)
