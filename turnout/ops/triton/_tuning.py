"""Tile overrides, for tuning a kernel inside a real decode step; made once and bound into the op table.

A tile that is fastest for a kernel alone is not always fastest in a captured decode step, where the
kernel overlaps its neighbours (PDL) and shares L2 with them. ``benchmarks/decode_step_ab.py`` re-captures
the step under several settings in one process; these settings are how it sets tiles without editing
code. Unset, the built-in choices apply. They come from ``turnout.envs`` (parsed and validated there). The op
table binds them into the implementations when it is resolved (``Impl.tunes``: ``small_m_tiles`` below and
``moe_decode_config.tuned`` turn the settings into keyword arguments, ``functools.partial``-bound), so a kernel never reads
a process global when it launches, and changing the environment after that changes nothing; the benchmark resolves a
table per setting instead (``turnout.ops.dispatch.resolve(..., tuning=envs.load(environ))``):

* ``TURNOUT_SMALL_M_TILES``: ``{"N,K": [block_n, block_k, num_warps, num_stages], ...}`` for the one-row path
  of ``small_m_linear`` and ``add_rms_norm_linear`` (turnout/ops/triton/linear.py), and of ``fp8_linear``
  (turnout/ops/triton/fp8.py; block_n a power of two, so a program's rows stay in one 128-row scale block);
* ``TURNOUT_MOE_DECODE_CONFIG``: ``{"field": value, ...}``, fields of ``DecodeConfig``
  (turnout/ops/triton/moe_decode_config.py, whose ``tuned`` binds them), for ``moe_experts``;
* ``TURNOUT_ATTN_DECODE`` (``attn_decode()``): ``{"num_splits": n, "block_n": n, "num_warps": n,
  "num_stages": n}`` (any subset) fixes the decode attention's split count (1: never split), KV tile and
  launch parameters (turnout/ops/triton/attention.py).
"""

from __future__ import annotations

from typing import Mapping

from turnout import envs


def small_m_tiles(tuning: envs.Envs) -> dict:
    """The one-row tile overrides to bind (none: nothing bound, the built-in choices)."""
    return {"tiles": tuning.small_m_tiles} if tuning.small_m_tiles else {}


def attn_decode() -> Mapping[str, int]:
    return envs.get().attn_decode


def interpreted() -> bool:
    """Whether Triton runs in its interpreter (TRITON_INTERPRET=1: CPU tests)."""
    return envs.get().triton_interpret
