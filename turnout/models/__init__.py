"""Model families. ``registry.get_model_class(hf_config.architectures)`` picks one, lazily; the dense
ones share ``decoder.DecoderForCausalLM`` (see its docstring for the hooks MoE families override)."""

from turnout.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
