"""Which transformers class a config names, and whether turnout can run it through that class's own code.

Everything here reads public transformers APIs only: the causal-LM auto mapping
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), the class attribute ``_supports_attention_backend`` (set by every model
whose attention goes through ``AttentionInterface``), configs. Two things no attribute declares are read from
the class's own ``forward`` source, and a class whose source says something else is refused with the reason,
never run with a guess:

- what the causal LM does to the LM head's output (Cohere multiplies by ``logit_scale``, Granite divides by
  ``logits_scaling``, HyperCLOVAX multiplies by it, Gemma 2 soft-caps): turnout computes the logits of the
  sampled rows only, so it applies the same transform itself (``HeadSpec``);
- that nothing sits between the base model's last hidden state and the head.

What a static look cannot see (a layer that mixes tokens without attention, bidirectional attention, a position
bias) is refused when the model is built (model.py's probe forward).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")


@dataclass(frozen=True)
class HeadSpec:
    """The causal LM's head: ``logits = module(hidden) <op> value`` then an optional soft-cap.

    ``module``: the attribute of the causal LM that projects (``lm_head``, ``embed_out``...). ``scale_attr``:
    (``"config"`` or ``"module"``, attribute name, ``"mul"`` | ``"div"``) or None. ``softcap_attr``: the config
    attribute of the final soft-cap (read from the text config), or None."""

    module: str
    scale: tuple[str, str, str] | None = None
    softcap_attr: str | None = None


def causal_lm_architectures() -> list[tuple[str, str]]:
    """(model_type, class name) of every causal LM transformers' auto mapping knows, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        for name in (names if isinstance(names, (list, tuple)) else [names]):
            out.append((model_type, name))
    return out


IMPORT_ERRORS: dict[str, str] = {}  # class name -> why this transformers could not import it (said in refusals)


def transformers_class(name: str):
    """The transformers class called ``name``, or None (not in this transformers, or it fails to import: the
    reason is kept in ``IMPORT_ERRORS``)."""
    import transformers

    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError) as e:
        IMPORT_ERRORS[name] = f"{type(e).__name__}: {e}"
        return None


def causal_lm_class(config):
    """The transformers causal-LM class for ``config``: the auto mapping's class for its ``model_type`` (what
    ``AutoModelForCausalLM.from_config`` builds), if the config's ``architectures`` (when it has any) name it;
    None otherwise."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    name = (names[0] if isinstance(names, (list, tuple)) else names) if names else None
    archs = getattr(config, "architectures", None)
    if name is None or (archs and name not in archs):  # a class the config names that transformers would not build
        return None
    return transformers_class(name)


_SLICE = re.compile(r"^(slice_indices = .*|"
                    r"hidden_states = slice_logits_to_keep\((hidden_states|\w+\.last_hidden_state|\w+\[0\]), "
                    r"logits_to_keep\)|"
                    r"hidden_states = \w+\.last_hidden_state|hidden_states = \w+\[0\]|"
                    r"hidden_states = \w+\.last_hidden_state\[:, slice_indices, :\])$")
_PROJECT = re.compile(r"^logits = self\.(\w+)\(hidden_states(\[:, slice_indices, :\])?\)"
                      r"(\.contiguous\(\)|\.float\(\))?( \* self\.config\.logits_scaling)?$")
_SCALES = {"logits = logits * self.logit_scale": ("module", "logit_scale", "mul"),
           "logits = logits / self.config.logits_scaling": ("config", "logits_scaling", "div"),
           "logits = logits * self.config.logits_scaling": ("config", "logits_scaling", "mul")}
_SOFTCAP = ("if self.config.final_logit_softcapping is not None:",
            "logits = logits / self.config.final_logit_softcapping", "logits = torch.tanh(logits)",
            "logits = logits * self.config.final_logit_softcapping")


def _statements(src: str) -> list[str]:
    """The forward's code lines between the base model's output and the loss, comments and blanks dropped."""
    body = src.split('"""')[-1] if src.count('"""') >= 2 else src
    lines = []
    for raw in body.splitlines():
        line = raw.split("  #")[0].strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def head_spec(cls) -> HeadSpec | str:
    """The head of causal LM ``cls`` read from its ``forward``, or the reason it cannot be read."""
    try:
        lines = _statements(inspect.getsource(cls.forward))
    except (OSError, TypeError) as e:
        return f"the source of {cls.__name__}.forward cannot be read ({e})"
    start = next((i for i, ln in enumerate(lines) if ln.startswith("logits = self.")), None)
    end = next((i for i, ln in enumerate(lines) if i > (start or 0) and (ln.startswith("loss") or
                                                                          ln.startswith("if labels"))), None)
    if start is None or end is None:
        return "its forward computes the logits in a way turnout does not recognise"
    base_end = max((i for i, ln in enumerate(lines[:start]) if ln.startswith(")")), default=None)
    between = lines[base_end + 1:start] if base_end is not None else []
    if any(not _SLICE.match(ln) for ln in between):
        return (f"its forward changes the hidden states before the LM head ({next(ln for ln in between if not _SLICE.match(ln))!r})")
    m = _PROJECT.match(lines[start])
    if m is None:
        return f"its LM head is computed as {lines[start]!r}, which turnout does not recognise"
    scale = ("config", "logits_scaling", "mul") if m.group(4) else None
    rest = lines[start + 1:end]
    softcap = None
    if rest and rest[0] in _SCALES and scale is None:
        scale, rest = _SCALES[rest[0]], rest[1:]
    if tuple(rest[:4]) == _SOFTCAP:
        softcap, rest = "final_logit_softcapping", rest[4:]
    if rest:
        return f"its forward post-processes the logits ({rest[0]!r}) in a way turnout does not recognise"
    return HeadSpec(module=m.group(1), scale=scale, softcap_attr=softcap)


def class_reason(cls) -> str | None:
    """Why causal LM class ``cls`` cannot run through the backend, from the class alone; None when it can."""
    if not getattr(cls, "_supports_attention_backend", False):
        return "its attention does not go through transformers' attention interface (_supports_attention_backend " \
               "is not set)"
    head = head_spec(cls)
    return head if isinstance(head, str) else None


def config_reason(config) -> str | None:
    """Why a config cannot run through the backend whatever its class; None when nothing in it says so."""
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)):
        other = sorted({str(t) for t in types} - set(ATTENTION_LAYER_TYPES))
        if other:
            return (f"its layer_types {other} mix tokens outside the attention interface (a recurrent or "
                    "convolution state turnout's backend does not keep)")
    return None


def unsupported_reason(config) -> str | None:
    """Why ``config`` cannot run through transformers' modeling code here; None when it can (as far as the
    config and the class say: the probe forward at build time checks the rest)."""
    cls = causal_lm_class(config)
    if cls is None:
        archs = getattr(config, "architectures", None)
        failed = [f"{n}: {IMPORT_ERRORS[n]}" for n in archs or [] if n in IMPORT_ERRORS]
        if failed:
            return f"this transformers cannot import its class ({failed[0][:300]})"
        if getattr(config, "auto_map", None):
            return (f"it needs the model repository's own code (auto_map; architectures {archs}), and turnout never "
                    "runs a model's code (--trust-remote-code stays refused)")
        return (f"transformers has no causal-LM class for it (architectures {archs}, model_type "
                f"{getattr(config, 'model_type', None)!r})")
    return class_reason(cls) or config_reason(config)
