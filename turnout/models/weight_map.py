"""The one weight-loading walk every model uses, driven by declarations on the model class.

It lives with the models (``DecoderForCausalLM.load_weights`` calls it; models import nothing of
``turnout.loader``); the loaders reach it through ``turnout.loader.weight_map``, which re-exports it.

A model declares:

- ``packed_modules_mapping = {"qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")], ...}``:
  checkpoint module ``q_proj`` loads into our ``qkv_proj`` as shard ``"q"``. Matched as a whole
  dotted name component, for weights and biases alike.
- optionally ``weight_name_rules``: ``[(regex, replacement, shard_id)]`` for mappings a component
  rename cannot say (e.g. per-expert tensors into one stacked expert parameter). ``shard_id`` is a
  value or a callable taking the ``re.Match``. Rules are tried first; the first match wins.
- optionally ``ignored_weights``: regexes of checkpoint tensors that are safe to drop (an instance
  attribute may extend it, e.g. ``lm_head.weight`` when the head is tied).

Each parameter's ``weight_loader(param, tensor, shard_id)`` does the copy (and, later, the tensor
parallel slicing). A packed parameter lists its ``shard_ids``; it is loaded once each was seen.
Missing tensors, unexpected tensors and shape mismatches raise ValueError naming the tensor.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from turnout.layers.weights import default_weight_loader

# Derived buffers some checkpoints carry; never parameters of ours.
ALWAYS_IGNORED = (r"(^|\.)rotary_emb\.inv_freq$", r"(^|\.)rotary_emb\.(cos|sin)_cached$")


def _compile_rules(model: nn.Module) -> list[tuple[re.Pattern, str, Any]]:
    rules = [(re.compile(p), repl, sid) for p, repl, sid in getattr(model, "weight_name_rules", ())]
    for packed, parts in getattr(model, "packed_modules_mapping", {}).items():
        for part, sid in parts:
            rules.append((re.compile(rf"(^|\.){re.escape(part)}(\.)"), rf"\g<1>{packed}\g<2>", sid))
    return rules


def map_weight_name(name: str, rules) -> tuple[str, Any]:
    """Checkpoint tensor name -> (our parameter name, shard id or None)."""
    for pattern, repl, sid in rules:
        m = pattern.search(name)
        if m:
            return pattern.sub(repl, name, count=1), (sid(m) if callable(sid) else sid)
    return name, None


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load ``(checkpoint name, tensor)`` pairs into ``model``; returns the parameter names loaded."""
    rules = _compile_rules(model)
    ignored = [re.compile(p) for p in (*ALWAYS_IGNORED, *getattr(model, "ignored_weights", ()))]
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    seen: dict[str, set] = {}
    with torch.no_grad():
        for name, tensor in weights:
            target, shard_id = map_weight_name(name, rules)
            param = params.get(target)
            if param is None:
                if any(p.search(name) for p in ignored):
                    continue
                raise ValueError(f"unexpected checkpoint tensor {name!r} {tuple(tensor.shape)}: the model "
                                 f"({type(model).__name__}) has no parameter {target!r}")
            if param.is_floating_point() and not (tensor.is_floating_point() or tensor.is_complex()):
                # copy_ would cast it silently: an int8 norm weight is a quantised or corrupt checkpoint
                raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} has dtype "
                                 f"{str(tensor.dtype).replace('torch.', '')}, but parameter {target!r} is "
                                 f"{str(param.dtype).replace('torch.', '')}: integer (quantised) weights are "
                                 f"not supported; use a float checkpoint (or a GGUF file)")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id) if shard_id is not None else loader(param, tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} -> parameter {target!r} "
                                 f"{tuple(param.shape)}: {e}") from None
            seen.setdefault(target, set()).add(shard_id)
    missing = []
    for pname, param in params.items():
        want = set(getattr(param, "shard_ids", (None,)))
        got = seen.get(pname, set())
        if None in got:  # a pre-packed tensor filled the whole parameter
            continue
        for sid in sorted(want - got, key=str):
            missing.append(_checkpoint_name(pname, sid, model))
    if missing:
        shown = ", ".join(repr(m) for m in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) for {type(model).__name__}: "
                         f"{shown}{more}")
    return set(seen)


def _checkpoint_name(param_name: str, shard_id, model: nn.Module) -> str:
    """The checkpoint name we expected for a parameter shard (best effort, for error messages)."""
    if shard_id is None:
        return param_name
    for packed, parts in getattr(model, "packed_modules_mapping", {}).items():
        for part, sid in parts:
            if sid == shard_id and f".{packed}." in f".{param_name}":
                return re.sub(rf"(^|\.){re.escape(packed)}\.", rf"\g<1>{part}.", param_name, count=1)
    return f"{param_name} (shard {shard_id!r})"
