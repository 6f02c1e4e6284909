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

# Derived buffers some checkpoints carry; never parameters of ours. A checkpoint's fp8 KV cache scales
# (self_attn.k_scale / v_scale, compressed-tensors' k_proj / v_proj.output_scale) load into the attention layer's
# k_scale / v_scale (KV_SCALE_RULES) where it has them (kv_cache_dtype fp8), and are dropped otherwise.
ALWAYS_IGNORED = (r"(^|\.)rotary_emb\.inv_freq$", r"(^|\.)rotary_emb\.(cos|sin)_cached$",
                  r"(^|\.)self_attn\.(k|v)_scale$", r"(^|\.)self_attn\.(k|v)_proj\.output_scale$")
KV_SCALE_RULES = ((r"(^|\.)self_attn\.(k|v)_scale$", r"\g<1>self_attn.attn.\g<2>_scale", None),
                  (r"(^|\.)self_attn\.(k|v)_proj\.output_scale$", r"\g<1>self_attn.attn.\g<2>_scale", None))


def _compile_rules(model: nn.Module) -> list[tuple[re.Pattern, str, Any]]:
    rules = [(re.compile(p), repl, sid) for p, repl, sid in (*KV_SCALE_RULES, *getattr(model, "weight_name_rules", ()))]
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
            loaded = _load_one(model, params, rules, ignored, name, tensor)
            if loaded is not None:
                seen.setdefault(loaded[0], set()).add(loaded[1])
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


def _load_one(model, params, rules, ignored, name: str, tensor: torch.Tensor) -> tuple[str, Any] | None:
    """One checkpoint tensor through the map into its parameter: (parameter name, shard id), or None when the
    tensor is one the model ignores. ValueError naming the tensor when it has no place or does not fit."""
    target, shard_id = map_weight_name(name, rules)
    param = params.get(target)
    if param is None:
        if any(p.search(name) for p in ignored):
            return None
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
    except (ValueError, RuntimeError, IndexError) as e:  # RuntimeError: a copy_ torch itself refused
        raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} -> parameter {target!r} "
                         f"{tuple(param.shape)}: {e}") from None
    return target, shard_id


def update_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], checked: bool = False) -> set[str]:
    """Overwrite some of ``model``'s parameters from ``(checkpoint name, full tensor)`` pairs (any subset, any
    order) through the same map and loaders as ``load_weights``, in place: every parameter keeps its storage
    and strides, so a re-layout done after the load (K-major CPU weights, turnout/layers/layout.py) and every
    pointer a captured CUDA graph holds stay valid. Returns the parameter names written.

    All-or-nothing: every tensor is first run through its loader against a meta-device stand-in of its
    parameter (the loaders' own shape, shard and range checks, nothing written), and only when all pass are
    they written. An unknown name or a tensor that does not fit is a ValueError naming it, the model unchanged.
    ``checked``: the caller ran ``check_weights`` on the same names and shapes already (meta tensors made from a
    checkpoint's headers), so ``weights`` is only iterated once, writing.
    """
    items = weights if checked else check_weights(model, weights)  # checked: streamed once, e.g. from disk
    rules = _compile_rules(model)
    ignored = [re.compile(p) for p in (*ALWAYS_IGNORED, *getattr(model, "ignored_weights", ()))]
    with torch.no_grad():
        params = dict(model.named_parameters())
        written = set()
        for name, tensor in items:
            loaded = _load_one(model, params, rules, ignored, name, tensor)
            if loaded is not None:
                written.add(loaded[0])
    return written


def check_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``update_weights``'s first half: every tensor through its loader against meta-device stand-ins of the
    parameters; nothing written. ValueError naming the first tensor that has no place or does not fit.
    Returns the pairs as a list (the iterable is consumed)."""
    items = list(weights)
    rules = _compile_rules(model)
    ignored = [re.compile(p) for p in (*ALWAYS_IGNORED, *getattr(model, "ignored_weights", ()))]
    with torch.no_grad(), _meta_stand_ins(model) as meta_params:
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"weight {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
            _load_one(model, meta_params, rules, ignored, name, tensor.to("meta"))
    return items


class _meta_stand_ins:
    """Within: each parameter of the model replaced, in every module that holds it, by a meta-device
    Parameter of the same shape, strides, dtype and attributes (``weight_loader``, ``shard_ids``), so the
    layers' own loaders, bound to their modules, check a tensor exactly as they would load it and write
    nothing. Yields {name: stand-in}. The real parameters are back on exit, whatever happened."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

    def __enter__(self) -> dict[str, nn.Parameter]:
        stand_in: dict[int, nn.Parameter] = {}
        for mod in self.model.modules():
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in stand_in:  # a tied parameter gets one stand-in, held wherever it is
                    m = nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta"),
                                     requires_grad=False)
                    m.__dict__.update(p.__dict__)
                    stand_in[id(p)] = m
                self.swapped.append((mod, pname, p))
                mod._parameters[pname] = stand_in[id(p)]
        return dict(self.model.named_parameters())

    def __exit__(self, *exc) -> None:
        for mod, pname, p in reversed(self.swapped):
            mod._parameters[pname] = p
        self.swapped.clear()


def _checkpoint_name(param_name: str, shard_id, model: nn.Module) -> str:
    """The checkpoint name we expected for a parameter shard (best effort, for error messages)."""
    if shard_id is None:
        return param_name
    for packed, parts in getattr(model, "packed_modules_mapping", {}).items():
        for part, sid in parts:
            if sid == shard_id and f".{packed}." in f".{param_name}":
                return re.sub(rf"(^|\.){re.escape(packed)}\.", rf"\g<1>{part}.", param_name, count=1)
    return f"{param_name} (shard {shard_id!r})"
