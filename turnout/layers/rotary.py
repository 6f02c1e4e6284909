"""Rotary position embedding: a float32 cos/sin cache and ``ops.rotary_embedding``.

Inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` for every scaled rope type
(llama3, linear, dynamic, yarn, longrope, ...), so scaling is computed exactly as HF computes it;
only the unscaled default is written out here (it is one line, and HF keeps it per model).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def rope_by_layer_type(config) -> bool:
    """Whether ``config.rope_parameters`` holds one dict per attention layer type (transformers 5's nested form,
    e.g. Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}) rather than one dict for every layer.
    Decided as transformers decides it: the keys name layer types."""
    params = getattr(config, "rope_parameters", None)
    types = set(getattr(config, "layer_types", None) or ()) | {"full_attention", "sliding_attention"}
    return isinstance(params, dict) and bool(types & set(params))


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The rope settings of an HF config, old (``rope_scaling`` + ``rope_theta``) or new
    (``rope_parameters``) style, as one dict with ``rope_type`` and ``rope_theta``. ``layer_type`` (an entry
    of ``config.layer_types``) picks that type's settings where the config has them per type (nested
    ``rope_parameters``, or the older Gemma 3 attribute ``rope_local_base_freq`` for sliding layers)."""
    if layer_type is not None and rope_by_layer_type(config):
        params = config.rope_parameters.get(layer_type)
        if params is None:
            raise ValueError(f"rope_parameters has no entry for layer type {layer_type!r} (layers without rope "
                             "are not supported)")
        params = dict(params)
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None) is not None:
        params = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}  # scaling is the global layers'
    else:
        params = dict(getattr(config, "rope_parameters", None) or {})
        if rope_by_layer_type(config):  # no layer type asked: the global layers' settings
            params = dict(params.get("full_attention") or {})
        for key, value in (getattr(config, "rope_scaling", None) or {}).items():
            params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if "partial_rotary_factor" not in params and getattr(config, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = config.partial_rotary_factor
    return params


def longrope_uses_long_factors(config, params: dict, max_position: int | None) -> bool:
    """LongRoPE (Phi-3/3.5/4-mini): whether the long factors rotate every position.

    transformers picks per forward: the long factors for every position once the sequence is longer than
    ``original_max_position_embeddings``, the short ones below, and drops its KV cache when a sequence
    crosses (every cached key re-rotated). A paged cache shared by prefix hits and chunks cannot re-rotate
    keys, so the choice is made once for the model, from the context it is built for (vLLM decides the same
    way, from its max_model_len): long when that context goes past ``original_max_position_embeddings``.
    Every sequence then equals transformers' long-factor forward, which is what transformers computes for a
    sequence past the original length; a model built for the original length runs the short factors."""
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                        None)
    if not original:
        raise ValueError("rope_type 'longrope' needs original_max_position_embeddings (in rope_parameters or the "
                         "config)")
    return max_position is not None and max_position > int(original)


def inv_freq_and_scaling(config, head_dim: int, layer_type: str | None = None,
                         max_position: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot_dim / 2] float32, attention scaling of cos/sin) for ``config`` (and its ``layer_type``).
    ``max_position``: the positions the cache covers (LongRoPE's choice of factors reads it)."""
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; transformers knows "
                         f"{sorted(ROPE_INIT_FUNCTIONS)} and 'default'")
    if rope_type == "dynamic":
        logger.warning("rope_type 'dynamic': the cache uses the base frequencies; HF rescales them "
                       "only past max_position_embeddings, which the engine does not exceed")
    kwargs = {}
    if rope_type == "longrope" and longrope_uses_long_factors(config, params, max_position):
        # transformers' own init function returns the long factors for a sequence this long
        kwargs["seq_len"] = int(params.get("original_max_position_embeddings")
                                or config.original_max_position_embeddings) + 1
    if rope_by_layer_type(config):  # transformers reads that type's dict itself (none asked: the global layers')
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"),
                                                           layer_type=layer_type or "full_attention", **kwargs)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_position: int, scaling: float = 1.0) -> torch.Tensor:
    """[max_position, rot_dim] float32: cos in the first rot_dim/2 columns, sin in the rest.
    Products in float32, as HF computes them, so positions match HF bit for bit before cos/sin."""
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())  # [P, rot/2]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


class RotaryEmbedding(nn.Module):
    """In-place RoPE on q [T, Hq, D] and k [T, Hk, D] (strided views of a fused qkv are fine)."""

    def __init__(self, head_dim: int, cos_sin_cache: torch.Tensor, is_neox: bool, ops):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = cos_sin_cache.shape[-1]
        if self.rotary_dim > head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} does not fit head_dim {head_dim}")
        self.is_neox = is_neox
        self.ops = ops
        # Float32 whatever the model dtype; not in the state dict (it is derived, not learned).
        self.register_buffer("cos_sin_cache", cos_sin_cache.to(torch.get_default_device(), torch.float32),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        self.ops.rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox)

    def with_qk_norm(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm, k_norm,
                     v: torch.Tensor | None = None, kv_cache=None, slot_mapping: torch.Tensor | None = None,
                     **cache_kwargs) -> None:
        """Per-head RMSNorm of q and k (the RMSNorm modules' weights and eps), then RoPE: one op,
        ``qk_norm_rotary``, in place. Given ``v``, ``kv_cache`` (k_cache, v_cache) and ``slot_mapping``,
        the op is ``qk_norm_rotary_cache``, which also writes the new k and v into the cache
        (``cache_kwargs``: an fp8 cache's scales, Attention.cache_kwargs)."""
        if q_norm.eps != k_norm.eps:
            raise ValueError(f"q_norm and k_norm eps differ ({q_norm.eps} vs {k_norm.eps})")
        if kv_cache is None:
            self.ops.qk_norm_rotary(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, self.cos_sin_cache,
                                    self.is_neox)
        else:
            self.ops.qk_norm_rotary_cache(positions, q, k, v, q_norm.weight, k_norm.weight, q_norm.eps,
                                          self.cos_sin_cache, self.is_neox, kv_cache[0], kv_cache[1], slot_mapping,
                                          **cache_kwargs)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
                f"max_position={self.cos_sin_cache.shape[0]}, neox={self.is_neox}")


def get_rope(config, head_dim: int, max_position: int, ops, is_neox: bool = True,
             layer_type: str | None = None) -> RotaryEmbedding:
    """The rotary embedding an HF ``config`` describes (theta, scaling, partial_rotary_factor), for the layers of
    ``layer_type`` where the config sets rope per layer type (``rope_parameters``)."""
    # Models are built under the loader's device and a bf16/fp16 default dtype; the frequencies must
    # not inherit either (HF's init functions make some tensors in the default dtype).
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            inv_freq, scaling = inv_freq_and_scaling(config, head_dim, layer_type, max_position)
            cache = build_cos_sin_cache(inv_freq, max_position, scaling)
    finally:
        torch.set_default_dtype(old)
    return RotaryEmbedding(head_dim, cache, is_neox, ops)
