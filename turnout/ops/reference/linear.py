"""small_m_linear: a linear projection of an input with few rows (decode-time projections)."""

import torch
import torch.nn.functional as F

from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase

MAX_M = 16  # the contract: at most this many rows


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias). x [M, K] with M <= 16, weight [N, K], bias [N] or None -> [M, N] in x's
    dtype. The same value as ``F.linear``; implementations accumulate in float32. It exists as an op of its
    own because at a few rows a projection is a pure weight stream, where a kernel written for that can read
    the weight faster than a BLAS tuned for compute (docs/benchmarks.md)."""
    if x.dim() != 2 or x.shape[0] > MAX_M:
        raise ValueError(f"small_m_linear takes x [M, K] with M <= {MAX_M}, got {tuple(x.shape)}")
    return F.linear(x, weight, bias)


def _samples(device, dtype, gen):
    # (M, N, K, bias): one row (the decode case), a few, the limit; K and N off the tile multiples.
    for m, n, k, bias in [(1, 64, 256, False), (1, 70, 300, True), (1, 1000, 96, False), (3, 48, 200, True),
                          (16, 130, 128, False), (2, 33, 1030, False)]:
        b = randn((n,), dtype, device, gen) if bias else None
        yield SampleCase(f"M{m}N{n}K{k}{'_bias' if bias else ''}",
                         (randn((m, k), dtype, device, gen), randn((n, k), dtype, device, gen, k ** -0.5), b))


SMALL_M_LINEAR = OpSpec(
    "small_m_linear", small_m_linear, _samples,
    tolerance={"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)},
    doc="y = x W^T (+ b) for x with at most 16 rows (decode projections, LM head)")


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None):
    """A pre-norm decoder's "add, norm, project" for a few rows, as one op.

    r = x + residual (rounded to x's dtype; r = x when residual is None), normed = rms_norm(r, norm_weight,
    eps) in x's dtype, y = normed @ weight.T (+ bias). x and residual [M, K] with M <= 16, weight [N, K].
    Returns (y [M, N], r [M, K], normed [M, K]); nothing is written in place. At batch-1 decode the Triton
    kernel normalises the row in every program of the projection, so the norm needs no kernel of its own
    and no memory round trip (``fused_add_rms_norm`` then ``small_m_linear`` cost two).
    """
    if x.dim() != 2 or x.shape[0] > MAX_M:
        raise ValueError(f"add_rms_norm_linear takes x [M, K] with M <= {MAX_M}, got {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rms_norm_linear: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    from turnout.ops.reference.norm import rms_norm

    r = x if residual is None else x + residual
    normed = rms_norm(r, norm_weight, eps).to(x.dtype)
    return F.linear(normed, weight, bias), r, normed


def _norm_linear_samples(device, dtype, gen):
    # (M, N, K, residual, bias): one row (the decode case, also the first layer's, without a residual), a few
    # rows, K and N off the tile multiples.
    for m, n, k, res, bias in [(1, 64, 256, True, False), (1, 70, 300, True, True), (1, 130, 512, False, False),
                               (3, 48, 200, True, True), (16, 40, 128, False, False), (2, 33, 1030, True, False)]:
        x = randn((m, k), dtype, device, gen)
        r = randn((m, k), dtype, device, gen) if res else None
        nw = randn((k,), dtype, device, gen, 0.5) + 1
        b = randn((n,), dtype, device, gen) if bias else None
        yield SampleCase(f"M{m}N{n}K{k}{'_res' if res else ''}{'_bias' if bias else ''}",
                         (x, r, nw, 1e-6, randn((n, k), dtype, device, gen, k ** -0.5), b))


ADD_RMS_NORM_LINEAR = OpSpec(
    "add_rms_norm_linear", add_rms_norm_linear, _norm_linear_samples,
    tolerance={"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)},
    doc="(rms_norm(x + residual) W^T (+ b), x + residual, rms_norm(x + residual)) for at most 16 rows")
