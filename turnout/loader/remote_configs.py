"""Checkpoints whose config.json points at the repository's own code (``auto_map``) for a model type transformers
does not know, although every field is one of a public transformers config's: read with that public class, never
with the repository's code (turnout never runs it).

Kimi-K2 (``model_type: "kimi_k2"``, ``architectures: ["DeepseekV3ForCausalLM"]``, ``auto_map`` to
``configuration_deepseek.DeepseekV3Config``) is DeepSeek-V3's architecture with DeepSeek-V3's fields, so
transformers' ``DeepseekV3Config`` reads it. A field that is neither that class's nor one of the fields DeepSeek-V3's
own released config.json carries (``V3_RELEASE_FIELDS``) is refused by name: turnout would not know what it changes.

Kimi's tokenizer is remote code too (``tokenization_kimi.TikTokenTokenizer`` over ``tiktoken.model``; no
``tokenizer.json``): transformers 5 can convert a ``tiktoken.model`` file, but only with GPT-4's split pattern, not
Kimi's own (it lives in tokenization_kimi.py), and without trust_remote_code ``AutoTokenizer`` stops at the
remote-code question. ``refuse_remote_tokenizer`` says so before AutoTokenizer is asked.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# model type -> (the public transformers config class that reads it, the architectures it must name)
READ_AS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kimi_k2": ("DeepseekV3Config", ("DeepseekV3ForCausalLM",)),
}

# Fields of DeepSeek-V3's released config.json (its configuration_deepseek.py) that transformers' DeepseekV3Config
# does not declare: read by turnout (topk_method, scoring_func, moe_layer_freq, quantization_config), training-only
# (aux_loss_alpha, seq_aux, ep_size), or names transformers itself translates (rope_scaling / rope_theta into
# rope_parameters, torch_dtype into dtype); and the file's own metadata (auto_map).
V3_RELEASE_FIELDS = frozenset({
    "auto_map", "aux_loss_alpha", "ep_size", "seq_aux", "topk_method", "scoring_func", "moe_layer_freq",
    "num_nextn_predict_layers", "quantization_config", "rope_scaling", "rope_theta", "torch_dtype", "dtype",
    "pretraining_tp", "transformers_version",
})


def _raw_config(path: Path) -> dict | None:
    try:
        raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def read_as_public(path: Path):
    """The config of the checkpoint directory ``path`` read with its public class (READ_AS), or None where its
    model type is not one of READ_AS. ValueError naming the field: another architecture, a field that is not
    the public class's nor DeepSeek-V3's."""
    raw = _raw_config(path)
    if raw is None or raw.get("model_type") not in READ_AS:
        return None
    model_type = raw["model_type"]
    cls_name, archs = READ_AS[model_type]
    import transformers

    cls = getattr(transformers, cls_name)
    where = f"{path}: config.json (model_type {model_type!r}, read with transformers' {cls_name})"
    if raw.get("architectures") != list(archs):
        raise ValueError(f"{where}: architectures {raw.get('architectures')!r}: turnout reads this model type only "
                         f"as {list(archs)}")
    known = set(cls().to_dict()) | V3_RELEASE_FIELDS
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: field(s) {', '.join(unknown)} are not {cls_name}'s nor DeepSeek-V3's, and turnout "
                         f"does not know what they change; it does not run the repository's code")
    fields = {k: v for k, v in raw.items() if k not in ("auto_map", "model_type")}
    try:
        config = cls.from_dict(fields)
    except Exception as e:
        if isinstance(e, ValueError) or type(e).__name__.startswith("StrictDataclass"):
            raise ValueError(f"{where}: {e}") from None
        raise
    logger.info("%s: model_type %r read with transformers' %s (its auto_map code is not run)", path, model_type,
                cls_name)
    return config


def refuse_remote_tokenizer(path: Path) -> None:
    """ValueError when the directory's tokenizer is the repository's own code (tokenizer_config.json's auto_map
    names an AutoTokenizer class transformers does not have), before AutoTokenizer would ask to run it."""
    try:
        cfg = json.loads((Path(path) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    auto = cfg.get("auto_map", {}).get("AutoTokenizer") if isinstance(cfg, dict) and isinstance(
        cfg.get("auto_map"), dict) else None
    if not auto:
        return
    import transformers

    name = cfg.get("tokenizer_class")
    if isinstance(name, str) and hasattr(transformers, name):
        return  # transformers has the class itself
    remote = auto[0] if isinstance(auto, (list, tuple)) else auto
    hint = ""
    if (Path(path) / "tiktoken.model").is_file() and not (Path(path) / "tokenizer.json").is_file():
        hint = (" Its vocabulary is a tiktoken.model file: transformers converts one only with GPT-4's split "
                "pattern, not the one this tokenizer's code defines, so the token ids would differ.")
    raise ValueError(f"{path}: the tokenizer is the repository's own code (tokenizer_config.json auto_map "
                     f"AutoTokenizer: {remote}; tokenizer_class {name!r} is not one transformers has), and turnout "
                     f"never runs a model's code.{hint} Pass a tokenizer of the same vocabulary that transformers "
                     "reads without code (tokenizer=, --tokenizer: a directory with a tokenizer.json).")
