"""What each decoder layer is made of, read once from the HF config and the family's declarations.

The decoder (turnout/models/decoder.py) is composed from these parts when it is built; nothing is decided per
step. A family declares what its config cannot say (class attributes of ``DecoderForCausalLM``: norm placement,
Gemma's (1 + w) norms, scaled embeddings, a window on every layer, attention sinks); everything a config field
does say is read here, for every family alike, with the meaning transformers gives it:

- ``layer_types`` (``"full_attention"`` / ``"sliding_attention"``) with ``sliding_window``: which layers attend
  over a window (Gemma 2/3, GPT-OSS, Qwen2 with ``use_sliding_window``);
- ``query_pre_attn_scalar``: the attention scale is its inverse square root instead of head_dim's (Gemma);
- ``attn_logit_softcapping``: attention scores soft-capped, cap * tanh(s / cap) (Gemma 2);
- ``final_logit_softcapping``: the same on the output logits (Gemma 2);
- rope per layer type (``rope_parameters`` nested by layer type, transformers 5; or ``rope_local_base_freq``):
  turnout/layers/rotary.py.
"""

from __future__ import annotations

from dataclasses import dataclass

NORM_PLACEMENTS = ("pre", "sandwich", "post")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention: the keywords of ``turnout.layers.attention.Attention`` beyond the head geometry.

    ``layer_type``: the config's name for it (selects the layer's rope where rope is set per type).
    ``scale``: None is head_dim ** -0.5. ``sliding_window``: keys within this many positions, the query's own
    included (HF's sliding mask); None attends over the whole causal context.
    """

    layer_type: str = "full_attention"
    sliding_window: int | None = None
    logit_softcap: float | None = None
    scale: float | None = None
    sinks: bool = False

    def attention_kwargs(self) -> dict:
        """The variant keywords for ``Attention(...)``, only those this layer has (a plain layer passes none)."""
        kw = {}
        if self.sliding_window is not None:
            kw["sliding_window"] = self.sliding_window
        if self.logit_softcap is not None:
            kw["logit_softcap"] = self.logit_softcap
        if self.sinks:
            kw["sinks"] = True
        return kw


def _positive(config, name: str) -> float | None:
    """A config field that is off when missing, None or 0 (Qwen2-MoE writes sliding_window 0 for none)."""
    value = getattr(config, name, None)
    return value if value else None


def layer_types(config) -> list[str]:
    """``config.layer_types``, checked: one known type per layer; every layer full attention when absent."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        return ["full_attention"] * n
    types = list(types)
    if len(types) != n:  # transformers refuses a config whose layer_types do not list each layer once
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers {n}")
    unknown = sorted(set(types[:n]) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
    return types


def attention_spec(config, layer_idx: int, window_every_layer: bool = False, sinks: bool = False) -> AttentionSpec:
    """Layer ``layer_idx``'s attention as ``config`` declares it. ``window_every_layer`` (Mistral, Mixtral: the
    config has ``sliding_window`` and no ``layer_types``): every layer attends over the window.

    A window that covers ``max_position_embeddings`` is no window (Mistral-style configs often carry one), so
    such a layer keeps the plain attention kernels."""
    if getattr(config, "use_bidirectional_attention", False):  # encoder use of the Gemma 3 stack (EmbeddingGemma)
        raise ValueError("use_bidirectional_attention is set: turnout's attention is causal only")
    layer_type = layer_types(config)[layer_idx]
    window = _positive(config, "sliding_window")
    if layer_type == "sliding_attention" and window is None:  # HF would build a mask with no window in it
        raise ValueError(f"layer_types[{layer_idx}] is 'sliding_attention' but sliding_window is "
                         f"{getattr(config, 'sliding_window', None)!r}: a sliding layer needs a positive window")
    if layer_type == "full_attention" and not (window_every_layer and getattr(config, "layer_types", None) is None):
        window = None
    if window is not None:
        if int(window) != window or window < 1:
            raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
        window = int(window)
        if window >= config.max_position_embeddings:
            window = None
    scalar = _positive(config, "query_pre_attn_scalar")
    cap = _positive(config, "attn_logit_softcapping")
    return AttentionSpec(layer_type=layer_type, sliding_window=window,
                         logit_softcap=None if cap is None else float(cap),
                         scale=None if scalar is None else float(scalar) ** -0.5, sinks=sinks)


def activation_name(config) -> tuple[str, str]:
    """(HF activation name, the config field it came from): ``hidden_activation`` where the config sets it
    (Gemma), else ``hidden_act`` (default silu)."""
    if getattr(config, "hidden_activation", None):
        return config.hidden_activation, "hidden_activation"
    return getattr(config, "hidden_act", None) or "silu", "hidden_act"


def final_logit_softcap(config) -> float | None:
    cap = _positive(config, "final_logit_softcapping")
    return None if cap is None else float(cap)
