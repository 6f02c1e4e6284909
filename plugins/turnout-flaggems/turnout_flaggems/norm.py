"""Norms and the gated activation through FlagGems, in turnout's contracts (turnout/ops/reference/norm.py,
activation.py). ``gems`` is the flag_gems module (library.loader binds it; the unit tests bind stand-ins)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gems) -> torch.Tensor:
    """x [..., H] -> [..., H]. FlagGems normalises over ``normalized_shape``, the last dimension here; it
    copies a strided x to a contiguous one itself and returns a new tensor."""
    return gems.rms_norm(x, [x.shape[-1]], weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       gems) -> None:
    """In place: residual += x; x = rms_norm(residual). FlagGems writes into ``x.contiguous()`` and
    ``residual.contiguous()`` and returns those: for a strided view they are copies, so what it wrote is
    copied back into the caller's tensors (a contiguous argument is written where it lies)."""
    out, res = gems.fused_add_rms_norm(x, residual, [x.shape[-1]], weight, eps)
    if out.data_ptr() != x.data_ptr():
        x.copy_(out)
    if res.data_ptr() != residual.data_ptr():
        residual.copy_(res)


def silu_and_mul(x: torch.Tensor, *, gems) -> torch.Tensor:
    """x [T, 2I] (gate, then up) -> [T, I]. FlagGems takes the two halves as separate (strided) tensors;
    its ``_out`` form skips the autograd wrapper of ``silu_and_mul``."""
    d = x.shape[-1] // 2
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
    return gems.silu_and_mul_out(x[..., :d], x[..., d:], out)
