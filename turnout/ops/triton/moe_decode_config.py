"""The decode MoE path's choices, made on the host: when the decode kernels run instead of the sorted
grouped GEMM (``use_decode``), and their tiles (``DecodeConfig``, with TURNOUT_MOE_DECODE_CONFIG's
overrides bound once by ``tuned``). Apart from moe_decode.py, which holds the kernels and their launch,
because moe.py and moe_fp8.py make the same choice without launching these kernels, and the measured
tile choices are read and changed on their own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Up to this many (token, slot) pairs per expert on average the decode path is used (Qwen3-30B-A3B:
# T * 8 / 128 <= 4, i.e. T <= 64); beyond, the sorted grouped GEMM. Also always for T * k <= 128.
DECODE_PAIRS_PER_EXPERT = 4
DECODE_MIN_PAIRS = 128


@dataclass(frozen=True)
class DecodeConfig:
    block_m: int = 16
    # gate/up: columns of I per program (two weight tiles: gate and up rows). 64 beat 32 in the captured
    # Qwen3-30B-A3B step on the H200 at batch 1 (-0.8 %) and batch 64 (-0.7 %); 16 and 128 lost
    # (docs/benchmarks.md, "RoPE inside attention by default")
    block_n1: int = 64
    block_k1: int = 128  # over H
    # down: columns of H per program and the step over I. Tuned in Qwen3-30B-A3B decode steps on the H200
    # (docs/benchmarks.md): 64 x 256 when a program serves one slot (T*k < E, batch 1), 128 x 128 when
    # every expert has a program and several rows (batch 64: 64 x 256 cost 9 % there).
    block_n2: int = 64
    block_k2: int = 256
    block_n2_many: int = 128
    block_k2_many: int = 128
    num_warps: int = 4
    num_stages: int = 4
    num_stages_many: int = 3  # gate/up when every expert has a program (batch 64: -2.1 %; batch 1 keeps 4)
    num_warps2: int | None = None  # down kernel (None: as gate/up)
    num_stages2: int | None = 3
    # one token: 1 runs the down kernel that also sums the slots, 0 the per-slot kernel and the sum kernel.
    # In the captured Qwen3-30B-A3B step on the H200 (docs/benchmarks.md, "norms fused into projections") 8 columns x
    # the whole I (768, in a 1024 tile) with 8 warps beat the pair by 1.8 %; 256- or 512-wide K tiles lost 7-14 %.
    one_token: int = 1
    block_n_one: int = 8
    block_k_one: int = 1024
    num_warps_one: int = 8
    num_stages_one: int = 4


DEFAULT_CONFIG = DecodeConfig()
CONFIG_ENV = "TURNOUT_MOE_DECODE_CONFIG"  # field overrides (turnout/ops/triton/_tuning.py)


def decode_config(fields) -> DecodeConfig:
    """DEFAULT_CONFIG with ``fields`` (TURNOUT_MOE_DECODE_CONFIG's, JSON and value types validated by turnout.envs;
    the names here) replaced: made once, when the op table binds it (turnout/ops/triton/_tuning.py)."""
    if not fields:
        return DEFAULT_CONFIG
    unknown = sorted(set(fields) - set(DecodeConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{CONFIG_ENV}: unknown DecodeConfig field(s) {unknown}; known: "
                         f"{sorted(DecodeConfig.__dataclass_fields__)}")
    nulls = sorted(name for name, value in fields.items() if value is None and name not in ("num_warps2", "num_stages2"))
    if nulls:
        raise ValueError(f"{CONFIG_ENV}: {nulls} must be positive ints (only num_warps2 / num_stages2 may be null)")
    return replace(DEFAULT_CONFIG, **fields)


def tuned(tuning) -> dict:
    """``moe_experts``'s keyword arguments from the op table's tuning settings (``turnout.envs.Envs``; bound when
    the table is resolved, Impl.tunes): the DecodeConfig of TURNOUT_MOE_DECODE_CONFIG, or nothing."""
    return {"decode_config": decode_config(tuning.moe_decode_config)} if tuning.moe_decode_config else {}


def use_decode(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Host ints only: the choice never syncs and is the same for every replay of a captured graph."""
    num_pairs = num_tokens * top_k
    return num_pairs <= max(DECODE_MIN_PAIRS, DECODE_PAIRS_PER_EXPERT * num_experts)
