"""RMSNorm through the op table, with the fused residual add of pre-norm decoders."""

from __future__ import annotations

import torch
from torch import nn

from turnout.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    """``forward(x)`` -> rms_norm(x); ``forward(x, residual)`` -> (normed, residual + x).

    The two-argument form is ``ops.fused_add_rms_norm``: it writes into ``x`` and ``residual`` (both
    [T, H], contiguous) and returns them, so a decoder layer does one pass over memory per norm.
    """

    def __init__(self, hidden_size: int, eps: float, ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)  # [H]
        self.weight.weight_loader = default_weight_loader
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
