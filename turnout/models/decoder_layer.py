"""The decoder layer in its three norm placements, chosen once per model (``NORM_PLACEMENTS``).

Every layer passes the residual stream on as ``(hidden, residual)``: the stream is their sum, and the next norm
adds them (``fused_add_rms_norm``: one pass over memory), so no layer spends a kernel on a bare residual add
when a norm follows it. The first layer gets ``residual=None`` (the embedding is the stream).

- ``pre`` (Llama, Qwen, Mistral, the MoE families): ``input_layernorm`` before attention,
  ``post_attention_layernorm`` before the MLP (HF's name, though it is the MLP's pre-norm).
- ``sandwich`` (Gemma 2/3): those pre-norms, named ``input_layernorm`` and ``pre_feedforward_layernorm``, and a
  norm of each block's output before it joins the stream, ``post_attention_layernorm`` and
  ``post_feedforward_layernorm``.
- ``post`` (OLMo 2): no pre-norms; ``post_attention_layernorm`` and ``post_feedforward_layernorm`` on the block
  outputs only.

Where the fusion plan fuses pre-norms (``plan.prenorm_linear``, at one row), each pre-norm is handed on as a
``PendingNorm`` that the block's first projection computes (turnout/layers/norm.py), in ``pre`` and ``sandwich``
alike: the sandwich's output norms are plain norms of a block's output, which no projection reads.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.norm import PendingNorm, RMSNorm

NormFactory = Callable[[], RMSNorm]  # a fresh [H] norm of the model's kind (eps, unit offset)


def _block_input(x: PendingNorm, block: nn.Module):
    """The pending norm for a block that takes one (its first projection computes it), else the tensor now."""
    return x if getattr(block, "takes_pending_norm", False) else x.tensor()


class DecoderLayer(nn.Module):
    """Pre-norm: the stream s; s += attn(norm(s)); s += mlp(norm(s))."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, config, ops, plan: FusionPlan = NO_FUSIONS,
                 norm: NormFactory | None = None):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        norm = norm or (lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, ops))
        self._make_norms(norm)
        # plan.prenorm_linear: at one row each pre-norm is computed inside the first projection that reads it
        # (add_rms_norm_linear, where the projection's shape takes it), not by a kernel of its own.
        self.fuse_prenorms = plan.prenorm_linear

    def _make_norms(self, norm: NormFactory) -> None:
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if self.fuse_prenorms and hidden.shape[0] == 1:
            return self._forward_fused_norms(positions, hidden, residual, kv_cache, meta)
        if residual is None:  # first layer: the embedding output is the residual stream
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def _forward_fused_norms(self, positions, hidden, residual, kv_cache, meta):
        x = PendingNorm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, _block_input(x, self.self_attn), kv_cache, meta)
        x = PendingNorm(self.post_attention_layernorm, hidden, x.residual)
        hidden = self.mlp(_block_input(x, self.mlp))
        return hidden, x.residual


class SandwichDecoderLayer(DecoderLayer):
    """Sandwich norms: s += post_attn_norm(attn(norm(s))); s += post_ff_norm(mlp(pre_ff_norm(s)))."""

    def _make_norms(self, norm: NormFactory) -> None:
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if self.fuse_prenorms and hidden.shape[0] == 1:
            return self._forward_fused_norms(positions, hidden, residual, kv_cache, meta)
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual

    def _forward_fused_norms(self, positions, hidden, residual, kv_cache, meta):
        x = PendingNorm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, _block_input(x, self.self_attn), kv_cache, meta)
        x = PendingNorm(self.pre_feedforward_layernorm, self.post_attention_layernorm(hidden), x.residual)
        hidden = self.mlp(_block_input(x, self.mlp))
        return self.post_feedforward_layernorm(hidden), x.residual


class PostNormDecoderLayer(DecoderLayer):
    """Post-norms only: s += post_attn_norm(attn(s)); s += post_ff_norm(mlp(s)). The blocks read the stream
    itself, so it is summed here (no norm to fuse the add into)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, config, ops, plan: FusionPlan = NO_FUSIONS,
                 norm: NormFactory | None = None):
        super().__init__(self_attn, mlp, config, ops, plan, norm)
        self.fuse_prenorms = False  # there is no pre-norm to fuse

    def _make_norms(self, norm: NormFactory) -> None:
        self.post_attention_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, positions, hidden, residual, kv_cache, meta):
        stream = hidden if residual is None else hidden + residual
        hidden = self.post_attention_layernorm(self.self_attn(positions, stream, kv_cache, meta))
        stream = stream + hidden
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


LAYER_CLASSES = {"pre": DecoderLayer, "sandwich": SandwichDecoderLayer, "post": PostNormDecoderLayer}
