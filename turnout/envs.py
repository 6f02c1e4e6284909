"""Every environment variable turnout reads, read here once, typed and validated.

``get()`` parses ``os.environ`` on first use and returns the same frozen ``Envs`` after that: nothing
in a hot path reads the environment. ``load(environ)`` parses a mapping of your own (tests), and
``reload()`` re-reads ``os.environ`` and replaces the cached value: the one way to change a setting in a
running process (``benchmarks/decode_step_ab.py`` re-captures a decode step under several tile settings,
so it calls ``reload()`` before each capture). A malformed value is a ``ValueError`` that names the
variable. The table in docs/architecture.md ("Environment variables") lists them all.

This module imports nothing of turnout: every layer may read it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

# The Triton kernels that take part in programmatic dependent launch (turnout/ops/triton/_pdl.py): the names
# TURNOUT_PDL_EARLY may list, and the names launch sites pass to ``pdl_args``.
PDL_KERNEL_NAMES = frozenset({"attention", "attention_merge", "linear", "routing", "moe_gate_up", "moe_down"})
ATTN_DECODE_KEYS = ("num_splits", "block_n", "num_warps", "num_stages")

# Every variable this module reads (docs/architecture.md lists each; tests/test_envs.py checks both).
VARIABLES = ("TURNOUT_OPS", "TURNOUT_PDL", "TURNOUT_PDL_EARLY", "TURNOUT_SMALL_M_TILES", "TURNOUT_MOE_DECODE_CONFIG",
             "TURNOUT_ATTN_DECODE", "TURNOUT_ROPE_ATTENTION", "TURNOUT_MLA_PREFILL", "TURNOUT_API_KEY", "TURNOUT_BENCH_CONFIGS",
             "TURNOUT_NATIVE_CACHE", "CXX", "XDG_CACHE_HOME", "TRITON_INTERPRET", "RANK", "RAY_LOCAL_WORLD_SIZE")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Envs:
    """The parsed environment. Field docs are the variables' meaning; defaults are the unset values."""

    ops: str | None = None  # TURNOUT_OPS: the op dispatch policy (docs/ops.md grammar), layered last
    pdl: bool = True  # TURNOUT_PDL: Triton decode kernels launch with PDL on sm90+ (off: 0)
    pdl_early: frozenset[str] | None = None  # TURNOUT_PDL_EARLY: kernels that launch their dependent early
    # TURNOUT_SMALL_M_TILES: (N, K) -> (block_n, block_k, num_warps, num_stages) of one-row small_m_linear
    small_m_tiles: Mapping[tuple[int, int], tuple[int, int, int, int]] = field(
        default_factory=lambda: MappingProxyType({}))
    # TURNOUT_MOE_DECODE_CONFIG: DecodeConfig field -> value (names checked by turnout/ops/triton/moe_decode_config.py)
    moe_decode_config: Mapping[str, int | None] = field(default_factory=lambda: MappingProxyType({}))
    # TURNOUT_ATTN_DECODE: decode attention's num_splits / block_n / num_warps / num_stages
    attn_decode: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    rope_attention: bool = True  # TURNOUT_ROPE_ATTENTION: q/k norm + RoPE + cache write inside decode attention
    # TURNOUT_MLA_PREFILL: latent attention's prefill, auto (by FLOPs) | absorbed | decompressed (layers/mla_prefill.py)
    mla_prefill: str = "auto"
    api_key: str | None = None  # TURNOUT_API_KEY: `turnout serve --api-key` default
    bench_configs: Path | None = None  # TURNOUT_BENCH_CONFIGS: an extra directory of benchmark model configs
    # TURNOUT_NATIVE_CACHE: where vendor.cpu_native's built library goes (default XDG_CACHE_HOME or ~/.cache,
    # then turnout/native); CXX: the C++ compiler that builds it (default c++, g++ or clang++ on PATH)
    native_cache: Path | None = None
    cxx: str | None = None
    xdg_cache_home: Path | None = None
    triton_interpret: bool = False  # TRITON_INTERPRET: Triton kernels run in the interpreter (CPU tests)
    # RANK, RAY_LOCAL_WORLD_SIZE: a verl trainer worker's rank and its node's worker count, as verl's Ray worker
    # group sets them (the verl rollout, turnout/integrations/verl/rollout.py, finds its server and socket by them)
    rank: int | None = None
    ray_local_world_size: int | None = None


def _text(environ: Mapping[str, str], name: str) -> str | None:
    """The stripped value, or None when unset or empty (empty means unset, as a shell's ``VAR=`` does)."""
    value = environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _bool(environ, name: str, default: bool) -> bool:
    text = _text(environ, name)
    if text is None:
        return default
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}, got {environ[name]!r}")


def _choice(environ, name: str, values: tuple[str, ...]) -> str:
    """One of ``values`` (unset: the first)."""
    text = _text(environ, name)
    if text is None:
        return values[0]
    if text.strip().lower() not in values:
        raise ValueError(f"{name}={text!r}: expected one of {', '.join(values)}")
    return text.strip().lower()


def _json_object(environ, name: str) -> dict:
    text = _text(environ, name)
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {text!r}")
    return value


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _small_m_tiles(environ, name: str = "TURNOUT_SMALL_M_TILES") -> Mapping:
    tiles = {}
    for key, tile in _json_object(environ, name).items():
        n, sep, k = key.partition(",")
        try:
            shape = (int(n), int(k))
        except ValueError:
            shape = None
        if not sep or shape is None or min(shape) < 1:
            raise ValueError(f"{name}: key {key!r} must be 'N,K' (two positive ints)")
        if not isinstance(tile, list) or len(tile) != 4 or not all(_positive_int(v) for v in tile):
            raise ValueError(f"{name}[{key}] must be [block_n, block_k, num_warps, num_stages] of positive ints, "
                             f"got {tile!r}")
        tiles[shape] = tuple(tile)
    return MappingProxyType(tiles)


def _moe_decode_config(environ, name: str = "TURNOUT_MOE_DECODE_CONFIG") -> Mapping:
    fields = _json_object(environ, name)
    for key, value in fields.items():
        if key == "one_token":
            if type(value) is not int or value not in (0, 1):
                raise ValueError(f"{name}: {key} must be 0 or 1, got {value!r}")
        elif not (_positive_int(value) or value is None):
            raise ValueError(f"{name}: {key} must be a positive int (or null where optional), got {value!r}")
    return MappingProxyType(fields)


def _attn_decode(environ, name: str = "TURNOUT_ATTN_DECODE") -> Mapping:
    tuning = _json_object(environ, name)
    unknown = sorted(set(tuning) - set(ATTN_DECODE_KEYS))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; known: {list(ATTN_DECODE_KEYS)}")
    for key, value in tuning.items():
        if not _positive_int(value):
            raise ValueError(f"{name}: {key} must be a positive integer, got {value!r}")
    if "block_n" in tuning and (tuning["block_n"] < 16 or tuning["block_n"] & (tuning["block_n"] - 1)):
        raise ValueError(f"{name}: block_n must be a power of two >= 16, got {tuning['block_n']!r}")
    return MappingProxyType(tuning)


def _pdl_early(environ, name: str = "TURNOUT_PDL_EARLY") -> frozenset | None:
    text = environ.get(name)
    if text is None:
        return None  # unset: the kernels' default (turnout/ops/triton/_pdl.py EARLY_DEFAULT); set empty: none
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - PDL_KERNEL_NAMES)
    if unknown:
        raise ValueError(f"{name}: unknown kernel name(s) {unknown}; known: {sorted(PDL_KERNEL_NAMES)}")
    return names


def _int(environ, name: str, minimum: int) -> int | None:
    text = _text(environ, name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {environ[name]!r}")
    return value


def _directory(environ, name: str) -> Path | None:
    text = _text(environ, name)
    if text is None:
        return None
    path = Path(text).expanduser()
    if not path.is_dir():
        raise ValueError(f"{name}={text!r} is not a directory")
    return path


def _path(environ, name: str) -> Path | None:
    """A path that need not exist yet (a cache directory made on first use)."""
    text = _text(environ, name)
    return None if text is None else Path(text).expanduser()


def load(environ: Mapping[str, str] | None = None) -> Envs:
    """``Envs`` of ``environ``; without one, the cached value of ``os.environ`` (parsed on first use)."""
    if environ is None:
        return get()
    return Envs(
        ops=_text(environ, "TURNOUT_OPS"),
        pdl=_bool(environ, "TURNOUT_PDL", True),
        pdl_early=_pdl_early(environ),
        small_m_tiles=_small_m_tiles(environ),
        moe_decode_config=_moe_decode_config(environ),
        attn_decode=_attn_decode(environ),
        rope_attention=_bool(environ, "TURNOUT_ROPE_ATTENTION", True),
        mla_prefill=_choice(environ, "TURNOUT_MLA_PREFILL", ("auto", "absorbed", "decompressed")),
        api_key=_text(environ, "TURNOUT_API_KEY"),
        bench_configs=_directory(environ, "TURNOUT_BENCH_CONFIGS"),
        native_cache=_path(environ, "TURNOUT_NATIVE_CACHE"),
        cxx=_text(environ, "CXX"),
        xdg_cache_home=_path(environ, "XDG_CACHE_HOME"),
        triton_interpret=_bool(environ, "TRITON_INTERPRET", False),
        rank=_int(environ, "RANK", 0),
        ray_local_world_size=_int(environ, "RAY_LOCAL_WORLD_SIZE", 1),
    )


_current: Envs | None = None


def get() -> Envs:
    """The process's settings: ``os.environ`` parsed once, on first use."""
    global _current
    if _current is None:
        _current = load(os.environ)
    return _current


def reload() -> Envs:
    """Re-read ``os.environ`` (after a benchmark or a test changed it) and return the new settings."""
    global _current
    _current = None
    return get()
