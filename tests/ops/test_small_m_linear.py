"""small_m_linear: the Triton kernel (one row on the CUDA cores, 2-16 rows through tl.dot) against
F.linear, its contract, and the layer hook that sends one-row projections through the op."""

import pytest
import torch
import torch.nn.functional as F

from turnout.layers.embedding import LMHead
from turnout.ops.reference.linear import small_m_linear as reference
from turnout.platforms.detect import detect_platform

PLATFORM = detect_platform("auto")
DEVICE = PLATFORM.device()
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
# tl.dot on bf16 is not trustworthy under the interpreter: the 2-16 row path is tested in fp32/fp16 there
CPU_DTYPES = [torch.float32, torch.float16]


def _triton():
    if not PLATFORM.triton_usable():
        pytest.skip("Triton does not run here")
    from turnout.ops.triton.linear import SmallMConfig, small_m_linear

    return small_m_linear, SmallMConfig


def _case(gen, m, n, k, dtype, bias):
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_kernel_every_row_count_and_ragged_shapes(dtype):
    kernel, config = _triton()
    gen = torch.Generator().manual_seed(0)
    for m, n, k, bias in ((1, 70, 300, True), (1, 9, 1030, False), (2, 33, 100, True), (5, 130, 64, False),
                          (16, 48, 272, True)):
        x, w, b = _case(gen, m, n, k, dtype, bias)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        for cfg in (None, config(block_n=8, block_k=64), config(block_n=64, block_k=512)):
            got = kernel(x, w, b, config=cfg)
            assert got.dtype == dtype and got.shape == (m, n)
            torch.testing.assert_close(got.float(), want, atol=TOL[dtype][0] * 10, rtol=TOL[dtype][1])


def test_kernel_one_row_bf16():
    """One row uses no tl.dot, so bf16 is checked under the interpreter too."""
    kernel, _ = _triton()
    gen = torch.Generator().manual_seed(1)
    x, w, b = _case(gen, 1, 40, 200, torch.bfloat16, True)
    torch.testing.assert_close(kernel(x, w, b).float(), F.linear(x.float(), w.float(), b.float()),
                               atol=2e-2, rtol=2e-2)


def test_one_row_tile_overrides(monkeypatch):
    """TURNOUT_SMALL_M_TILES overrides the one-row tiles by "N,K" (benchmarks/decode_step_ab.py tunes with
    it; the op table binds them: tests/ops/test_tuning_binding.py); other shapes keep the built-in choice; a
    malformed value is a ValueError naming the variable."""
    kernel, config = _triton()
    from turnout import envs
    from turnout.ops.triton.linear import pick_config

    default, other, two_rows = pick_config(1, 40, 200), pick_config(1, 41, 200), pick_config(2, 40, 200)
    tiles = envs.load({"TURNOUT_SMALL_M_TILES": '{"40,200": [2, 64, 1, 1]}'}).small_m_tiles
    assert pick_config(1, 40, 200, tiles) == config(block_n=2, block_k=64, num_warps=1, num_stages=1)
    assert default != pick_config(1, 40, 200, tiles)
    assert pick_config(1, 41, 200, tiles) == other and pick_config(2, 40, 200, tiles) == two_rows
    gen = torch.Generator().manual_seed(3)
    x, w, b = _case(gen, 1, 40, 200, torch.float32, True)
    torch.testing.assert_close(kernel(x, w, b, tiles=tiles), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    for bad in ('{"40,200": [2, 64]}', '{"40,200": [0, 64, 1, 1]}', "[1, 2]", "{40: 1"):
        monkeypatch.setenv("TURNOUT_SMALL_M_TILES", bad)
        with pytest.raises(ValueError, match="TURNOUT_SMALL_M_TILES"):  # at start-up (turnout.envs)
            envs.reload()


def test_kernel_strided_input_and_transposed_weight():
    kernel, _ = _triton()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2 * 96, generator=gen).to(DEVICE)[:, ::2]  # non-unit stride along K
    w = torch.randn(96, 50, generator=gen).to(DEVICE).t()  # [50, 96] view of a K-major tensor
    torch.testing.assert_close(kernel(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_more_than_16_rows_is_a_value_error():
    x, w = torch.zeros(17, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="M <= 16"):
        reference(x, w)
    if PLATFORM.triton_usable():
        kernel, _ = _triton()
        with pytest.raises(ValueError, match="at most 16 rows"):
            kernel(x.to(DEVICE), w.to(DEVICE))
        with pytest.raises(ValueError, match=r"weight \[N, K\]"):
            kernel(torch.zeros(1, 8, device=DEVICE), torch.zeros(4, 9, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 16])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048), (24576, 4096)])
def test_gpu_bf16_real_shapes(m, n, k):
    """Qwen3-30B-A3B qkv / o / router / LM head and Qwen3-8B gate_up, bf16 on the GPU."""
    kernel, _ = _triton()
    gen = torch.Generator().manual_seed(n + m)
    x, w, b = _case(gen, m, n, k, torch.bfloat16, m == 2)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(kernel(x, w, b).float(), want, atol=3e-2, rtol=2e-2)


def test_default_tiles_are_powers_of_two_for_every_width():
    """Triton tiles must be powers of two: N = 192 once gave a 3-row tile (N // 64) and failed to compile."""
    small_m_linear, _ = _triton()
    from turnout.ops.triton.linear import pick_config

    for n in list(range(1, 2100)) + [4096, 5120, 151936]:
        bn = pick_config(1, n, 2048).block_n
        assert bn & (bn - 1) == 0, (n, bn)
    gen = torch.Generator().manual_seed(21)
    x, w, _ = _case(gen, 1, 192, 64, torch.float32, False)
    torch.testing.assert_close(small_m_linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", CPU_DTYPES + [torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,res", [(1, True), (1, False), (3, True)])
def test_add_rms_norm_linear_against_the_reference(dtype, m, res):
    """The fused pre-norm: y, x + residual and the normed rows, on ragged K and N (a single program and several),
    against add, norm and projection in torch."""
    if m > 1 and dtype == torch.bfloat16 and not PLATFORM.is_gpu:
        pytest.skip("bfloat16 tl.dot is wrong under the Triton interpreter; checked on GPU")
    _triton()
    from turnout.ops.reference.linear import add_rms_norm_linear as ref
    from turnout.ops.triton.linear import SmallMConfig, add_rms_norm_linear

    gen = torch.Generator().manual_seed(22)
    x = torch.randn(m, 300, generator=gen).to(DEVICE, dtype)
    r = torch.randn(m, 300, generator=gen).to(DEVICE, dtype) if res else None
    nw = (torch.rand(300, generator=gen) + 0.5).to(DEVICE, dtype)
    w = (torch.randn(70, 300, generator=gen) * 300 ** -0.5).to(DEVICE, dtype)
    atol, rtol = TOL[dtype] if dtype != torch.bfloat16 else (6e-2, 3e-2)
    for cfg in (None, SmallMConfig(block_n=16, block_k=64, num_warps=2, num_stages=2)):
        got = add_rms_norm_linear(x, r, nw, 1e-6, w, None, config=cfg)
        want = ref(x, r, nw, 1e-6, w, None)
        for g, e in zip(got, want):
            torch.testing.assert_close(g.float(), e.float(), atol=atol, rtol=rtol)
        if not res:
            assert got[1] is x  # no residual: the stream is x itself, nothing copied
    with pytest.raises(ValueError, match="norm_weight"):
        add_rms_norm_linear(x, r, nw[:10], 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_linear(x, torch.zeros(m, 10, device=DEVICE, dtype=dtype), nw, 1e-6, w)


def test_lm_head_writes_float32_logits_into_out():
    """compute_logits(out=): a captured decode step's logits go straight into its static float32 buffer (one
    cast-and-store); the values equal the plain path's."""
    torch.manual_seed(0)
    head = LMHead(32, 16)
    head.weight.data.normal_()
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    head = head.to(torch.bfloat16)
    out = torch.full((3, 32), float("nan"))
    got = head(x, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.float32
    torch.testing.assert_close(out, head(x), rtol=0, atol=0)
