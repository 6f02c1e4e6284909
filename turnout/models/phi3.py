"""Phi-3 / Phi-3.5 / Phi-4 (``Phi3ForCausalLM``): the Mistral decoder (``sliding_window`` on every layer where the
config sets one, e.g. Phi-3-mini-4k's 2047) whose checkpoints store q/k/v as one ``qkv_proj`` and gate/up as one
``gate_up_proj`` (they load as the packed tensors they are, and split per part under tensor parallelism), rope
on the first ``partial_rotary_factor`` of each head (Phi-4-mini), and LongRoPE scaling with short and long
factors (Phi-3.5, Phi-4-mini: turnout/layers/rotary.py, ``longrope_uses_long_factors``)."""

from turnout.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    window_every_layer = True
    qkv_bias = False
    o_bias = False
