"""A model's HF config, read as the loader reads it (directory, .gguf file, Hub id), before any weight: the
strict-config and remote-code refusals said as ValueErrors naming what is wrong."""

from __future__ import annotations

from pathlib import Path

from turnout.loader.remote_configs import read_as_public
from turnout.loader.source import ModelSource, resolve_source


def load_config(src: ModelSource):
    if src.kind == "gguf":
        from turnout.loader import gguf

        config = gguf.load_config(src.path)
    elif (config := read_as_public(src.path)) is not None:  # a remote-code model type with public fields
        pass
    else:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(src.path))
        except Exception as e:
            # transformers 5's strict configs validate their fields (huggingface_hub's StrictDataclassError, not a
            # ValueError): the caller's mistake, said as one, with the validator's words (they name the field)
            if type(e).__name__.startswith("StrictDataclass"):
                cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
                raise ValueError(f"{src.path}: config.json: {e}{cause}") from None
            if isinstance(e, (ValueError, KeyError, OSError)):
                _refuse_remote_code(src.path, e)
            raise
    if not getattr(config, "architectures", None):
        # GGUF configs (and some hand-written ones) name only the model type: the class transformers' auto
        # mapping builds for it (gemma3_text -> Gemma3ForCausalLM), else the config class's name
        # (LlamaConfig -> LlamaForCausalLM, Qwen3MoeConfig -> Qwen3MoeForCausalLM).
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        mapped = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
        mapped = mapped[0] if isinstance(mapped, (list, tuple)) else mapped
        name = type(config).__name__
        config.architectures = ([mapped] if mapped else [name[: -len("Config")] + "ForCausalLM"]
                                if name.endswith("Config") else None)
    return config


def _refuse_remote_code(path: Path, error: Exception) -> None:
    """A ValueError saying so when transformers could not read a config because it needs the model repository's
    own code (``auto_map``); turnout never runs a model's code (``trust_remote_code`` stays refused)."""
    import json

    try:
        raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(raw, dict) and isinstance(raw.get("auto_map"), dict) and raw["auto_map"]:
        raise ValueError(f"{path}: its config needs the model repository's own code (auto_map: "
                         f"{', '.join(sorted(raw['auto_map']))}; model_type {raw.get('model_type')!r} is not one "
                         "transformers knows), and turnout never runs a model's code (trust_remote_code stays "
                         f"refused): neither a native class nor transformers' modeling code can run it") from error


def config_of(model: str | None):
    """The HF config of ``model`` (as ``load_model`` reads it: directory, .gguf file, Hub id), no weights read."""
    return load_config(resolve_source(model, config_only=True))
