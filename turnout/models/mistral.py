"""Mistral: the Llama decoder with ``sliding_window`` on every layer (Mistral 7B v0.1: 4096). Later Mistral
checkpoints set it to null, and a window that covers ``max_position_embeddings`` is no window: those run the
plain attention kernels."""

from turnout.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    window_every_layer = True
