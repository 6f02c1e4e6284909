"""The example's kernels: pure PyTorch, each the reference's computation with fewer temporaries.

A real vendor imports its SDK here (``import my_sdk``) and calls its kernels; this module shows the
contract they must keep: the reference's signature, its rounding where it matters, and for an op that
writes into its arguments every element the reference writes and no other. ``turnout ops --check``
compares each against the reference (turnout/ops/reference/activation.py and norm.py).
"""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> [T, I] = silu(gate) * up. The product is written into silu's output
    instead of a third tensor; same dtype, same rounding as the reference."""
    d = x.shape[-1] // 2
    out = F.silu(x[..., :d])  # [T, I]
    return out.mul_(x[..., d:])


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual <- x + residual; x <- rms_norm(residual) * weight. Normalised in float32, rounded
    to x's dtype before the weight is applied (as the reference, and HF, do); one float32 temporary."""
    residual.add_(x)
    # A copy even for float32 input (.float() would return residual itself, and mul_ would scale it too:
    # the conformance suite catches exactly that).
    xf = residual.to(torch.float32, copy=True)  # [T, H]
    xf.mul_(torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps)))
    x.copy_(xf.to(x.dtype).mul_(weight))
