"""A model cut to its first N decoder layers, with its final norm and LM head: the draft of a layer-truncated
self-speculation (``speculative_config``'s ``num_draft_layers``, turnout/engine/speculative.py)."""

from __future__ import annotations

import re

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def truncate_layers(hf_config, n: int) -> None:
    """``hf_config`` cut to its first ``n`` decoder layers (per-layer lists cut too; no MTP layers after them)."""
    total = int(hf_config.num_hidden_layers)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= total:
        raise ValueError(f"num_hidden_layers: the model has {total} decoder layers, {n!r} asked "
                         "(speculative_config.num_draft_layers)")
    hf_config.num_hidden_layers = n
    for name in ("layer_types",):
        value = getattr(hf_config, name, None)
        if isinstance(value, (list, tuple)) and len(value) == total:
            setattr(hf_config, name, list(value)[:n])
    if getattr(hf_config, "num_nextn_predict_layers", None):
        hf_config.num_nextn_predict_layers = 0  # stored after the last decoder layer: cut with the rest


def first_layers_only(weights, n: int):
    """The checkpoint's tensors without those of decoder layers ``n`` and after."""
    for name, tensor in weights:
        m = _LAYER.search(name)
        if m is None or int(m.group(1)) < n:
            yield name, tensor
