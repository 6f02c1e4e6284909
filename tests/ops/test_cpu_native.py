"""vendor.cpu_native (turnout/ops/vendors/cpu/native.py): the kernels built with this machine's compiler equal the
reference on every path and scale dtype, give the same bits whatever the thread count, and a machine where nothing
builds gets the reason, not an error (the policy then takes vendor.cpu)."""

from __future__ import annotations

import re

import pytest
import torch

from turnout.ops.reference import w4a16 as ref
from turnout.ops.spec import ImplUnavailable
from turnout.ops.vendors.cpu import native


@pytest.fixture(scope="module")
def w4a16_linear():
    try:
        return native.w4a16_linear_factory()
    except ImplUnavailable as e:
        pytest.skip(f"vendor.cpu_native unavailable: {e}")


@pytest.mark.parametrize("sz_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 32, 33])  # one row, the tile, its largest, dequantise + GEMM
def test_every_path_and_scale_dtype_equals_the_reference(w4a16_linear, m, x_dtype, sz_dtype):
    gen = torch.Generator().manual_seed(m)
    qw, sz = ref.random_w4(192, 256, 64, sz_dtype, "cpu", gen)
    x = torch.randn(m, 256, generator=gen).to(x_dtype)
    perm = torch.randperm(256, generator=gen)
    bias = torch.randn(192, generator=gen)
    got = w4a16_linear(x, qw, sz, 64, perm, bias)
    want = ref.w4a16_linear(x.float(), qw, sz, 64, perm, bias)  # float32 arithmetic in both
    assert got.dtype == x_dtype
    tol = 3e-5 if x_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.to(x_dtype).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("m", [1, 7, 200])
def test_the_same_bits_on_one_thread_and_on_two(w4a16_linear, m):
    gen = torch.Generator().manual_seed(3)
    qw, sz = ref.random_w4(256, 128, 32, torch.float32, "cpu", gen)
    x = torch.randn(m, 128, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w4a16_linear(x, qw, sz, 32)
        torch.set_num_threads(2)
        two = w4a16_linear(x, qw, sz, 32)
    finally:
        torch.set_num_threads(before)
    if m <= 32:  # each 64-row block is one thread's whole sum; the GEMM path is BLAS's to split
        assert torch.equal(one, two)
    else:
        torch.testing.assert_close(one, two, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compiler,why", [("/nonexistent/c++", "No such file"), ("false", "exit 1")])
def test_a_machine_where_nothing_builds_gets_the_reason(tmp_path, compiler, why):
    from turnout import envs

    settings = envs.load({"CXX": compiler, "TURNOUT_NATIVE_CACHE": str(tmp_path)})
    with pytest.raises(ImplUnavailable, match=f"building the CPU kernels with {re.escape(compiler)} failed.*{why}"):
        native.build(settings)  # not the process's cached load
    assert not list(tmp_path.rglob("*.so"))  # no half-written library left to load next time


def test_the_policy_falls_back_to_vendor_cpu_when_the_build_fails(tmp_path):
    import subprocess
    import sys

    code = ("from turnout.ops import resolve; from turnout.platforms import detect_platform; "
            "t = resolve(detect_platform('cpu'), ops=['w4a16_linear']); r = t.resolutions['w4a16_linear']; "
            "print(t.chosen('w4a16_linear')); print([c.reason for c in r.candidates if c.impl == 'vendor.cpu_native'][0])")
    env = {**__import__("os").environ, "CXX": "false", "TURNOUT_NATIVE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    chosen, reason = out.stdout.strip().splitlines()
    assert chosen == "vendor.cpu" and "building the CPU kernels with false failed" in reason
