"""The one-row kernel of the Triton ``fp8_linear`` (turnout/ops/triton/fp8.py) under its built-in tiles and forced
ones, against the op's reference: per-row and block scales, N and K off every tile, one K tile and many, a bias, rows
whose largest element is far beyond float16's range or far below its normal range, every product at its largest. The op's tolerance (atol, rtol) with
atol scaled by the magnitude of x, so that 1e6 and 1e-6 are held to what 1 is. The conformance suite runs only the
shape table's default per shape."""

import pytest
import torch

from turnout.ops.reference._util import randn
from turnout.ops.reference.fp8 import _MM_TOL, fp8_linear, quantize_weight
from turnout.platforms.detect import detect_platform

PLATFORM = detect_platform("auto")
DEVICE = PLATFORM.device()

if not PLATFORM.triton_usable()[0]:
    pytest.skip("Triton does not run here", allow_module_level=True)

from turnout.ops.triton import fp8 as tfp8  # noqa: E402

# (N, K, bias, x magnitude): N off 16/32/64, K off 128/256, magnitudes beyond float16 (65504) and below its normals
SHAPES = [(48, 200, False, 1.0), (130, 300, True, 3.0), (256, 384, False, 1e6), (16, 128, True, 1e-6),
          (200, 1000, False, 40.0), (16, 4096, False, 1.0)]


def _cases(dtype):
    gen = torch.Generator().manual_seed(7)
    dtype = getattr(torch, dtype)
    for n, k, bias, mag in SHAPES:
        mag = min(mag, 1e3) if dtype == torch.float16 else mag  # float16 x itself ends at 65504
        for layout in ("row", "block"):
            w, s = quantize_weight(randn((n, k), torch.float32, "cpu", gen, k ** -0.5), layout)
            x = randn((1, k), dtype, DEVICE, gen, mag)
            b = randn((n,), dtype, DEVICE, gen) if bias else None
            yield f"N{n}K{k}_{layout}_x{mag:g}", mag, (x, w.to(DEVICE), s.to(DEVICE), b)
    # every product at its largest and of one sign: the float16 lanes' worst case
    w, s = quantize_weight(torch.ones(32, 4096), "row")
    yield "saturated", 1.0, (torch.ones(1, 4096, dtype=dtype, device=DEVICE), w.to(DEVICE), s.to(DEVICE), None)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("tiles", [None, (2, 128, 4, 3), (16, 512, 8, 3), (1, 4096, 4, 2)])
def test_one_row_kernel(dtype, tiles):
    by_shape = None if tiles is None else {(n, k): tiles for n, k, _, _ in SHAPES}
    atol, rtol = _MM_TOL[dtype]
    for name, mag, args in _cases(dtype):
        want = fp8_linear(*(a.cpu() if a is not None else a for a in args)).float()
        got = tfp8.fp8_linear(*args, tiles=by_shape).float().cpu()
        err = (got - want).abs()
        assert torch.isfinite(got).all(), name
        assert (err <= atol * mag + rtol * want.abs()).all(), f"{name}: max error {err.max():.3g}"
