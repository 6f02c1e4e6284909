"""HF ``architectures`` name -> model class, imported lazily. A class is built as ``cls(hf_config, ops, plan)``:
the op table and the fusion plan (turnout/layers/fusion.py), both frozen before the model exists."""

from __future__ import annotations

import importlib

# architecture name -> "module:class" under turnout.models
MODELS: dict[str, str] = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "mistral:MistralForCausalLM",
    "Ernie4_5ForCausalLM": "ernie4_5:Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe:Ernie4_5_MoeForCausalLM",
    "DeepseekV2ForCausalLM": "deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "deepseek:DeepseekV3ForCausalLM",
    "Gemma2ForCausalLM": "gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "gemma3:Gemma3ForCausalLM",
    "Olmo2ForCausalLM": "olmo2:Olmo2ForCausalLM",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "qwen3_moe:Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM": "qwen2_moe:Qwen2MoeForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "Glm4MoeForCausalLM": "glm4_moe:Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM": "deepseek:Glm4MoeLiteForCausalLM",
    "GptOssForCausalLM": "gpt_oss:GptOssForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(MODELS)


def get_model_class(architectures: list[str] | None):
    """The class for the first supported name in ``architectures``; a clear error otherwise."""
    for arch in architectures or []:
        if arch in MODELS:
            module, _, cls = MODELS[arch].partition(":")
            return getattr(importlib.import_module(f"turnout.models.{module}"), cls)
    raise ValueError(f"unsupported model architecture {architectures!r}; turnout supports: "
                     f"{', '.join(supported_architectures())}")
