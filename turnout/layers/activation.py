"""Activations called through the op table."""

from __future__ import annotations

import torch
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU: [T, 2I] (gate then up, as ``gate_up_proj`` packs them) -> [T, I]."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
