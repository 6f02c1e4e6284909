"""Tile overrides, for tuning a kernel inside a real decode step.

A tile that is fastest for a kernel alone is not always fastest in a captured decode step, where the
kernel overlaps its neighbours (PDL) and shares L2 with them. ``benchmarks/decode_step_ab.py`` re-captures
the step under several settings in one process; these settings are how it sets tiles without editing
code. Unset, the built-in choices apply. They come from ``turnout.envs`` (parsed and validated there, once;
``envs.reload()`` re-reads them, which the benchmark does before each capture), and a kernel looks them up
when it is launched, i.e. at graph capture:

* ``TURNOUT_SMALL_M_TILES`` (``small_m_tiles()``): ``{"N,K": [block_n, block_k, num_warps, num_stages], ...}``
  for the one-row path of ``small_m_linear`` (turnout/ops/triton/linear.py), and of ``fp8_linear``
  (turnout/ops/triton/fp8.py; block_n a power of two, so a program's rows stay in one 128-row scale block);
* ``TURNOUT_MOE_DECODE_CONFIG`` (``moe_decode_fields()``): ``{"field": value, ...}``, fields of
  ``DecodeConfig`` (turnout/ops/triton/moe_decode.py);
* ``TURNOUT_ATTN_DECODE`` (``attn_decode()``): ``{"num_splits": n, "block_n": n, "num_warps": n,
  "num_stages": n}`` (any subset) fixes the decode attention's split count (1: never split), KV tile and
  launch parameters (turnout/ops/triton/attention.py).
"""

from __future__ import annotations

from typing import Mapping

from turnout import envs


def small_m_tiles() -> Mapping[tuple[int, int], tuple[int, int, int, int]]:
    return envs.get().small_m_tiles


def moe_decode_fields() -> Mapping[str, int | None]:
    return envs.get().moe_decode_config


def attn_decode() -> Mapping[str, int]:
    return envs.get().attn_decode


def interpreted() -> bool:
    """Whether Triton runs in its interpreter (TRITON_INTERPRET=1: CPU tests)."""
    return envs.get().triton_interpret
