"""Speculative decoding's settings, in vLLM's spelling: ``speculative_config`` is a dict (or its JSON text, as
``--speculative-config '{...}'`` gives it) with

- ``method``: "ngram" (prompt lookup: no model), "draft_model" (a smaller model with the target's tokenizer,
  ``model``), "mtp" (the target checkpoint's own multi-token-prediction layer: no ``model``) or "eagle3" (an
  EAGLE-3 head's directory, ``model``): the last two draft from the target's hidden states
  (turnout/engine/hidden_drafts.py). Given a ``model`` and no method, "draft_model". "eagle" (EAGLE-1/2),
  "medusa", ... are vLLM's names of methods turnout does not build: refused by name, never silently served as
  something else;
- ``num_speculative_tokens``: k, the most drafts one sequence verifies in a step (1..16);
- ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram): the n-gram lengths matched, longest first; one
  given stands for both, none given is 5 and 5 (vLLM's defaults);
- ``num_draft_layers`` (draft_model): the draft is the first N decoder layers of its model, with that model's
  final norm and LM head (a layer-truncated self-draft: without ``model``, the target's own checkpoint);
- ``disable_by_batch_size``: no drafts in a step where this many sequences or more are running (verifying
  drafts costs more than it saves once the batch fills the device; None: always draft).

Every error is a ValueError naming ``speculative_config.<field>``. Nothing here imports the engine: the
configuration is checked before a model is loaded; what needs the models (the draft's vocabulary) is
checked where they are loaded (turnout/engine/speculative.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_SPECULATIVE_TOKENS = 16
METHODS = ("ngram", "draft_model", "mtp", "eagle3")
NOT_BUILT = ("eagle", "medusa", "mlp_speculator", "suffix")
FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
          "num_draft_layers", "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    model: str | None = None  # draft_model: None with num_draft_layers is the target's own checkpoint
    disable_by_batch_size: int | None = None
    num_draft_layers: int | None = None


def _bad(field: str, why: str) -> ValueError:
    return ValueError(f"speculative_config.{field}: {why}" if field else f"speculative_config: {why}")


def _positive_int(value, field: str, upper: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper is not None and value > upper):
        span = f"in [1, {upper}]" if upper is not None else ">= 1"
        raise _bad(field, f"must be an integer {span}, got {value!r}")
    return value


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """``value``: None, a dict, its JSON text, or a SpeculativeConfig -> the checked settings (None: off)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _bad("", f"not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise _bad("", f"must be a dict (or its JSON text), got {type(value).__name__}")
    unknown = [k for k in value if k not in FIELDS]
    if unknown:
        raise _bad(str(unknown[0]), f"unknown field (turnout reads {', '.join(FIELDS)})")
    model = value.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise _bad("model", f"must be a model id or path, got {model!r}")
    method = value.get("method")
    layers = value.get("num_draft_layers")
    if method is None:
        if model in ("ngram", "[ngram]"):  # vLLM's older spelling of the n-gram method
            method, model = "ngram", None
        elif model is not None or layers is not None:
            method = "draft_model"
        else:
            raise _bad("method", f"required ({', '.join(METHODS)}), or a draft \"model\" or \"num_draft_layers\"")
    if method in NOT_BUILT:
        raise _bad("method", f"{method!r} is not built in turnout (it serves {', '.join(METHODS)})")
    if method not in METHODS:
        raise _bad("method", f"unknown method {method!r} ({', '.join(METHODS)})")
    if "num_speculative_tokens" not in value:
        raise _bad("num_speculative_tokens", "required: the most draft tokens a sequence verifies in a step")
    k = _positive_int(value["num_speculative_tokens"], "num_speculative_tokens", MAX_SPECULATIVE_TOKENS)
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    if layers is not None:
        layers = _positive_int(layers, "num_draft_layers")
    if method == "ngram":
        if model is not None:
            raise _bad("model", "the ngram method uses no model")
        if layers is not None:
            raise _bad("num_draft_layers", "only for the draft_model method")
        lo = None if lo is None else _positive_int(lo, "prompt_lookup_min", 64)
        hi = None if hi is None else _positive_int(hi, "prompt_lookup_max", 64)
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        if lo > hi:
            raise _bad("prompt_lookup_min", f"({lo}) must not exceed prompt_lookup_max ({hi})")
    elif method in ("mtp", "eagle3"):
        if method == "mtp" and model is not None:
            raise _bad("model", "the mtp method drafts with the target checkpoint's own layers: give no model")
        if method == "eagle3" and model is None:
            raise _bad("model", "the eagle3 method needs the EAGLE-3 head's directory (or Hub id)")
        if layers is not None:
            raise _bad("num_draft_layers", "only for the draft_model method")
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None:
                raise _bad(name, "only for the ngram method")
        lo = hi = 0
    else:
        if model is None and layers is None:
            raise _bad("model", "the draft_model method needs the draft's model id or path (or num_draft_layers: "
                                "the target's first layers as the draft)")
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None:
                raise _bad(name, "only for the ngram method")
        lo = hi = 0
    cap = value.get("disable_by_batch_size")
    if cap is not None:
        cap = _positive_int(cap, "disable_by_batch_size")
    return SpeculativeConfig(method, k, lo, hi, model, cap, layers)
