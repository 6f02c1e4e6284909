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


MODEL_IMPLS = ("auto", "native", "transformers")


def native_architecture(architectures: list[str] | None) -> str | None:
    """The first of ``architectures`` turnout has a native class for, or None."""
    return next((a for a in architectures or [] if a in MODELS), None)


def resolve_model_class(hf_config, model_impl: str = "auto"):
    """The class that runs ``hf_config`` under ``model_impl`` (EngineConfig.model_impl), decided from the config
    alone, before any weight is read:

    - ``native``: turnout's own class (a ValueError when it has none);
    - ``transformers``: transformers' modeling code with turnout's attention and kernels
      (turnout/models/transformers_backend), where that class supports the attention interface;
    - ``auto``: native when there is a native class, else transformers.

    A ValueError names the architecture and why it cannot run."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl: unknown implementation {model_impl!r} ({', '.join(MODEL_IMPLS)})")
    archs = getattr(hf_config, "architectures", None)
    native = native_architecture(archs)
    if model_impl != "transformers" and native is not None:
        return get_model_class([native])
    if model_impl == "native":
        raise ValueError(f"model_impl='native': turnout has no native class for {archs!r} (native: "
                         f"{', '.join(supported_architectures())}); model_impl 'auto' or 'transformers' runs it through "
                         "transformers' modeling code where its class supports the attention interface")
    from turnout.models.transformers_backend import unsupported_reason
    from turnout.models.transformers_backend.support import causal_lm_class

    why = unsupported_reason(hf_config)
    if why is not None:
        hf_cls = None if archs else causal_lm_class(hf_config)
        name = archs or (hf_cls.__name__ if hf_cls is not None else getattr(hf_config, "model_type", None))
        native_note = "" if model_impl == "transformers" else "turnout has no native class for it, and "
        raise ValueError(f"unsupported model architecture {name!r}: {native_note}transformers' modeling code cannot "
                         f"run here: {why}")
    from turnout.models.transformers_backend import TransformersForCausalLM

    return TransformersForCausalLM
