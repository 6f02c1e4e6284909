"""Norms on CPU through torch's fused F.rms_norm (float32; other dtypes take the reference path,
which normalises in float32 and rounds before scaling, as HF does)."""

import torch
import torch.nn.functional as F

from turnout.ops.reference import norm as ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return ref.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))
