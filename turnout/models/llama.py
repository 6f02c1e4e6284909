"""Llama family: Llama 2/3.x, SmolLM2, Mistral-style configs (attention_bias, mlp_bias, tied heads)."""

from turnout.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Biases follow ``config.attention_bias`` / ``config.mlp_bias``; rope scaling from the config."""
