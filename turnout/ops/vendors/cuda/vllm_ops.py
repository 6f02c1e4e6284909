"""Adapters from vLLM's compiled CUDA ops to turnout's op signatures (docs/architecture.md).

Each ``load_*`` is an Impl factory: it returns the adapter once the underlying op was fetched for real,
or raises ImplUnavailable saying what is missing. ``hasattr(torch.ops, "_C")`` proves nothing: the
namespace is created on demand for any name. Only ``getattr(torch.ops._C, "rms_norm")``
does, and it raises when the library that defines the op was never loaded.
"""

from __future__ import annotations

import importlib

import torch

from turnout.ops.spec import ImplUnavailable


def _op(namespace: str, name: str, library: str = "vllm._C"):
    try:
        importlib.import_module(library)  # loading the shared library registers its ops
    except Exception as e:
        raise ImplUnavailable(f"import {library} failed: {type(e).__name__}: {e}") from e
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError) as e:
        raise ImplUnavailable(f"torch.ops.{namespace}.{name} does not exist after importing {library} "
                              f"(a build without compiled ops?): {e}") from e


def load_rms_norm():
    op = _op("_C", "rms_norm")

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        op(out, x, weight, eps)
        return out

    return rms_norm


def load_fused_add_rms_norm():
    op = _op("_C", "fused_add_rms_norm")

    def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        op(x, residual, weight, eps)

    return fused_add_rms_norm


def load_silu_and_mul():
    op = _op("_C", "silu_and_mul")

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)
        op(out, x.contiguous())
        return out

    return silu_and_mul


def load_reshape_and_cache():
    # The "flash" variant uses turnout's cache layout [num_blocks, block_size, num_kv_heads, head_dim].
    op = _op("_C_cache_ops", "reshape_and_cache_flash")

    def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
        one = torch.ones((), dtype=torch.float32, device=key.device)
        op(key, value, k_cache, v_cache, slot_mapping, "auto", one, one)

    return reshape_and_cache
