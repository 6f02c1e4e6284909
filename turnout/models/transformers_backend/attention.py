"""The attention function transformers' modeling code calls, registered as ``"turnout"``.

Every attention module of a transformers model that supports the attention interface calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, attention_mask, scaling=...,
sliding_window=..., softcap=..., s_aux=..., **kwargs)`` with q / k / v as ``[batch, heads, tokens, head_dim]``
after its own projections, norms and rotary embedding, and whatever keyword arguments the caller of the model
passed down. Turnout calls the base model with one batch row holding every token of the step (prefill chunks
and decodes packed back to back) and passes the step as ``turnout_step``: a ``StepAttention`` holding the
per-step metadata (slot mapping, block tables, sequence lengths, query starts: ``AttentionMetadata``, the same
object the native models get), the KV caches and one turnout ``Attention`` layer per attention call. The
function writes this step's k and v into the paged cache and attends through the op table
(``reshape_and_cache``, ``paged_attention``), exactly the ops the native attention layer calls, with the
layer's scale, sliding window, soft-cap and sinks as transformers passes them. No transformers Cache object is
made, and since ``"turnout"`` has no mask function of its own, transformers builds no mask (its mask helpers
return None for an implementation they do not know).

A model is built once with a ``ProbeAttention`` as ``turnout_step`` (model.py): each call records what that
layer is (kv heads, head dims, window, soft-cap, scale, sinks), which gives the KV spec of every layer before
any cache exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IMPLEMENTATION = "turnout"


@dataclass(frozen=True)
class LayerCall:
    """What one attention call of the model is, as the probe saw it: this rank's heads and head dims, and the
    variant transformers passes for it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int  # of q and k
    value_head_dim: int
    scale: float | None
    sliding_window: int | None
    logit_softcap: float | None
    has_sinks: bool

    @property
    def cache_head_dim(self) -> int:
        """The head dim the cache stores: k's and v's padded to the larger (zeros change no dot product)."""
        return max(self.head_dim, self.value_head_dim)


class ProbeAttention:
    """``turnout_step`` of the probe forward: records every call, returns zeros of the output's shape."""

    def __init__(self):
        self.calls: list[LayerCall] = []
        self.refusals: list[str] = []

    def __call__(self, module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None,
                 sinks=None, is_causal=None, position_bias=None):
        if is_causal is False or getattr(module, "is_causal", True) is False:
            self.refusals.append("its attention is bidirectional (is_causal is False); turnout's attention is causal")
        if isinstance(attention_mask, torch.Tensor) and attention_mask.is_floating_point():
            self.refusals.append("its attention adds a mask the model computes itself (a learned or positional "
                                 "bias), which turnout's attention kernels do not take")
        if position_bias is not None:
            self.refusals.append("its attention adds a position bias, which turnout's attention kernels do not take")
        if getattr(module, "is_cross_attention", False):
            self.refusals.append("it has cross-attention")
        window = int(sliding_window) if sliding_window else None
        self.calls.append(LayerCall(
            num_heads=query.shape[1], num_kv_heads=key.shape[1], head_dim=query.shape[-1],
            value_head_dim=value.shape[-1], scale=None if scaling is None else float(scaling), sliding_window=window,
            logit_softcap=float(softcap) if softcap else None, has_sinks=sinks is not None))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


@dataclass
class StepAttention:
    """``turnout_step`` of a real forward: this step's metadata and caches, the model's attention layers in call
    order (``turnout.layers.attention.Attention``), and the count of calls made so far."""

    meta: object  # turnout.layers.attention.AttentionMetadata
    kv_caches: list
    layers: list
    calls: int = field(default=0)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None,
                 sinks=None, is_causal=None, position_bias=None):
        i = self.calls
        self.calls += 1
        layer = self.layers[i]
        k_cache, v_cache = self.kv_caches[i]
        meta = self.meta if self.meta.group_tables is None else self.meta.layer_metas()[i]  # its table group's
        d = k_cache.shape[-1]
        q, k, v = (_tokens_heads_dim(x, d) for x in (query, key, value))  # [T, H, D] each, padded to the cache's D
        kw = layer.cache_kwargs
        layer.ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, **kw)
        variant = layer.variant_kwargs
        if sinks is not None:  # transformers' own parameter (this rank's heads), float32 for the softmax
            variant["sinks"] = sinks.float()
        out = layer.ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                        meta.max_query_len, meta.max_seq_len, layer.scale, **kw, **variant)
        return out[None, :, :, :value.shape[-1]], None  # [1, T, Hq, Dv]: what transformers' modules reshape


def _tokens_heads_dim(x: torch.Tensor, d: int) -> torch.Tensor:
    """[1, H, T, d'] -> contiguous [T, H, d], zero-padded when d' < d."""
    x = x[0].transpose(0, 1)
    if x.shape[-1] < d:
        x = torch.nn.functional.pad(x, (0, d - x.shape[-1]))
    return x.contiguous()


def turnout_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, s_aux=None, sinks=None, is_causal=None, position_bias=None, turnout_step=None,
                      **kwargs):
    """The function registered as ``"turnout"``: hands the call to the step the model was called with."""
    if turnout_step is None:
        raise RuntimeError("the 'turnout' attention implementation runs only inside turnout's engine (the model was "
                           "called without turnout_step)")
    return turnout_step(module, query, key, value, attention_mask, scaling=scaling, sliding_window=sliding_window,
                        softcap=softcap, sinks=s_aux if s_aux is not None else sinks, is_causal=is_causal,
                        position_bias=position_bias)


def register() -> None:
    """Register ``turnout_attention`` under ``"turnout"`` with transformers' attention interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, turnout_attention)
