"""RMSNorm through the op table, with the fused residual add of pre-norm decoders."""

from __future__ import annotations

import torch
from torch import nn

from turnout.layers.weights import default_weight_loader


class RMSNorm(nn.Module):
    """``forward(x)`` -> rms_norm(x); ``forward(x, residual)`` -> (normed, residual + x).

    The two-argument form is ``ops.fused_add_rms_norm``: it writes into ``x`` and ``residual`` (both
    [T, H], contiguous) and returns them, so a decoder layer does one pass over memory per norm.

    ``unit_offset`` (Gemma): the checkpoint stores w and the model scales by (1 + w). The parameter holds
    1 + w, added once when a tensor is loaded (checkpoint, weight update), so every norm op and every fused
    kernel that reads ``weight`` (the pre-norm fused into a projection, q/k norm inside rope) computes the
    Gemma norm with no op of its own and no per-step add. The sum is taken in float32 before it is cast.
    """

    def __init__(self, hidden_size: int, eps: float, ops, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)  # [H]
        self.weight.weight_loader = _unit_offset_loader if unit_offset else default_weight_loader
        self.eps = eps
        self.ops = ops
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", weight=1+w" if self.unit_offset else "")


def _unit_offset_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """A checkpoint's w into a parameter that holds 1 + w (``RMSNorm(unit_offset=True)``)."""
    default_weight_loader(param, loaded_weight.float() + 1.0, shard_id)


class PendingNorm:
    """``rms_norm(x + residual)`` not computed yet: the first one-row projection that reads it computes it.

    At batch-1 decode, where the fusion plan fuses pre-norms (``plan.prenorm_linear``), a decoder layer hands
    one of these to its attention and MLP blocks (those whose class sets ``takes_pending_norm``) instead of
    the normed tensor. The block's first projection that takes norms (``takes_norm``, decided for its shape
    when it was built) calls ``fused_projection``: the ``add_rms_norm_linear`` op normalises the row inside
    the projection's own kernel, so the norm costs neither a kernel nor a dependent memory round trip, and it
    also returns the normed row and x + residual for the rest of the layer. Anything else that needs the
    values calls ``.tensor()``, which runs the plain ``fused_add_rms_norm`` in place, exactly the unfused
    layer.
    """

    def __init__(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
        self.norm, self.x, self.residual_in = norm, x, residual
        self._normed: torch.Tensor | None = None
        self._residual: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    def dim(self) -> int:
        return self.x.dim()

    def fused_projection(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """normed W^T (+ b) in one ``add_rms_norm_linear`` launch, keeping the normed row and the residual;
        None once the norm is computed (a later projection takes ``.tensor()``) or beyond one row."""
        if self._normed is not None or self.x.shape[0] != 1:
            return None
        y, self._residual, self._normed = self.norm.ops.add_rms_norm_linear(
            self.x, self.residual_in, self.norm.weight, self.norm.eps, weight, bias)
        return y

    def tensor(self) -> torch.Tensor:
        """The normed values [T, H] (computed now if no projection has yet)."""
        if self._normed is None:
            if self.residual_in is None:  # first layer: the embedding output is the residual stream
                self._normed, self._residual = self.norm(self.x), self.x
            else:
                self._normed, self._residual = self.norm(self.x, self.residual_in)
        return self._normed

    @property
    def residual(self) -> torch.Tensor:
        """x + residual, the residual stream after this norm."""
        self.tensor()
        return self._residual


def resolve(x) -> torch.Tensor:
    """The tensor behind ``x`` (a tensor, or a PendingNorm computed now if it must be)."""
    return x.tensor() if isinstance(x, PendingNorm) else x
