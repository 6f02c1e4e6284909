"""Tile overrides from the environment, for tuning a kernel inside a real decode step.

A tile that is fastest for a kernel alone is not always fastest in a captured decode step, where the
kernel overlaps its neighbours (PDL) and shares L2 with them. ``benchmarks/decode_step_ab.py`` re-captures
the step under several settings in one process; these variables are how it sets tiles without editing
code. Unset, the built-in choices apply. They are read when a kernel is launched, i.e. at graph capture.

* ``TURNOUT_SMALL_M_TILES``: ``{"N,K": [block_n, block_k, num_warps, num_stages], ...}`` for the one-row
  path of ``small_m_linear`` (turnout/ops/triton/linear.py);
* ``TURNOUT_MOE_DECODE_CONFIG``: ``{"field": value, ...}``, fields of ``DecodeConfig``
  (turnout/ops/triton/moe_decode.py);
* ``TURNOUT_ATTN_DECODE``: ``{"num_splits": n, "block_n": n, "num_warps": n, "num_stages": n}`` (any
  subset) fixes the decode attention's split count (1: never split), KV tile and launch parameters
  (turnout/ops/triton/attention.py).
"""

from __future__ import annotations

import functools
import json
import os


@functools.lru_cache(maxsize=32)
def _parse(name: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {text!r}")
    return value


def env_object(name: str) -> dict:
    """The JSON object in environment variable ``name`` ({} when unset or empty); ValueError naming the
    variable when it is not a JSON object."""
    text = os.environ.get(name, "").strip()
    return _parse(name, text) if text else {}
