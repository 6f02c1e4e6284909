"""Qwen2 / Qwen2.5: the Llama decoder with biased q/k/v projections (o_proj has none)."""

from turnout.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    qkv_bias = True
    o_bias = False
