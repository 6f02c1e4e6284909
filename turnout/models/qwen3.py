"""Qwen3: per-head RMSNorm of q and k before rope; explicit ``head_dim``; biases per ``attention_bias``."""

from turnout.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
