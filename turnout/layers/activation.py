"""Gated activations called through the op table: [T, 2I] (gate then up, as ``gate_up_proj`` packs them) -> [T, I].

``gated_activation(name, ops)`` picks the module for an HF activation name once, when the MLP is built."""

from __future__ import annotations

import torch
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU: silu(gate) * up."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """GeGLU with the tanh approximation of gelu (Gemma's ``gelu_pytorch_tanh``): gelu(gate) * up."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_and_mul(x)


class ClampedSwiGLU(nn.Module):
    """GPT-OSS's gated unit: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)."""

    def __init__(self, ops, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.ops, self.alpha, self.limit = ops, float(alpha), float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.clamped_swiglu(x, self.alpha, self.limit)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


# HF activation names (config.hidden_act / hidden_activation) -> our gated module. "gelu" alone is the exact erf
# gelu in HF and has no op here, so it is refused rather than approximated.
_BY_NAME = {"silu": SiluAndMul, "swish": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul,
            "gelu_tanh": GeluTanhAndMul, "gelu_new": GeluTanhAndMul}


def gated_activation(name: str, ops, field: str = "hidden_act") -> nn.Module:
    """The gate-and-multiply module for HF activation ``name``; a ValueError naming ``field`` when there is none."""
    cls = _BY_NAME.get(name)
    if cls is None:
        raise ValueError(f"{field} {name!r} is not supported; supported: {', '.join(sorted(_BY_NAME))}")
    return cls(ops)
