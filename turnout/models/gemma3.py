"""Gemma 3, text only (``Gemma3ForCausalLM``: the 1B model, or the text tower of a checkpoint saved as one):
Gemma 2's layer (sandwich norms, (1 + w) RMSNorm, scaled embeddings, GeGLU, ``query_pre_attn_scalar``) with
per-head q/k norms (also (1 + w)), five sliding-window layers to one global (``layer_types``), and rope set per
layer type: the sliding layers use their own base frequency (transformers 5's nested ``rope_parameters``, or
``rope_local_base_freq``), the global ones the scaled rope of ``rope_parameters["full_attention"]``."""

from turnout.models.decoder import DecoderForCausalLM


class Gemma3ForCausalLM(DecoderForCausalLM):
    norm_placement = "sandwich"
    norm_unit_offset = True
    scale_embeddings = True
    qk_norm = True
