"""Gemma 2: sandwich norms (a norm before and after each block) with Gemma's (1 + w) RMSNorm, embeddings scaled by
sqrt(hidden_size), a GeGLU MLP (``hidden_activation``: gelu, tanh approximation), attention scaled by
``query_pre_attn_scalar`` ** -0.5 with soft-capped scores (``attn_logit_softcapping``), sliding-window layers
interleaved with global ones (``layer_types``, ``sliding_window``), soft-capped output logits
(``final_logit_softcapping``), a tied head. All but the first four are config fields the decoder reads."""

from turnout.models.decoder import DecoderForCausalLM


class Gemma2ForCausalLM(DecoderForCausalLM):
    norm_placement = "sandwich"
    norm_unit_offset = True
    scale_embeddings = True
