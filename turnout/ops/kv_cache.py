"""The KV cache's storage dtype (``EngineConfig.kv_cache_dtype``): ``auto`` (the model's dtype) or ``fp8``.

With ``fp8`` every cache tensor is ``float8_e4m3fn`` and each attention layer holds two float32 scales,
``k_scale`` / ``v_scale`` (1.0, or a checkpoint's): a cache write stores ``clamp(x / scale, -448, 448)``
rounded to e4m3, attention reads ``fp8 * scale``. Half the bytes per token, so twice the tokens in the same
memory and half the bytes a decode step's attention reads.

Which implementations may serve the ops that read or write the cache (``FP8_KV_OPS``) with an fp8 cache is
their own declaration, ``Impl(..., kv_fp8=True)`` (or a ``check(platform) -> (ok, why)``); the reference, the
meaning, always can. The engine's policy carries ``kv_cache=fp8`` (``Policy.for_config``), and the dispatch
excludes the others with the reason "does not handle an fp8 KV cache", so the table falls back to the next
and the start-up line names what was skipped. The ops get the scales as the trailing keywords ``k_scale`` /
``v_scale`` only then: with ``auto`` no implementation sees them, and nothing changes.

The block copies (``copy_blocks``, the swap ops) move bytes and are dtype-blind; those that could not copy
fp8 elements view them as bytes.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8")
FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = 448.0
# the ops whose implementations quantise into or dequantise out of the cache
FP8_KV_OPS = ("reshape_and_cache", "qk_norm_rotary_cache", "paged_attention", "rotary_paged_attention",
              "mla_reshape_and_cache", "mla_paged_attention", "mla_gather_cache")


def cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache tensors are allocated in."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: unknown {kv_cache_dtype!r} ({', '.join(KV_CACHE_DTYPES)})")
    return FP8_KV if kv_cache_dtype == "fp8" else model_dtype


def check_fp8_storage(device: torch.device, platform_name: str) -> None:
    """ValueError naming kv_cache_dtype when this device cannot hold and convert float8_e4m3fn tensors (a
    cast there and back, and a byte copy: what the cache writes, reads and copies need)."""
    try:
        x = torch.tensor([1.5, -3.0], device=device)
        y = x.to(FP8_KV)
        z = torch.empty_like(y)
        z.copy_(y)
        ok = torch.equal(z.to(torch.float32).cpu(), torch.tensor([1.5, -3.0]))
        why = "a float32 -> e4m3 -> float32 round trip changed exact values" if not ok else ""
    except Exception as e:  # noqa: BLE001 - any refusal of the dtype by the device means no fp8 cache here
        ok, why = False, f"{type(e).__name__}: {e}"
    if not ok:
        raise ValueError(f"kv_cache_dtype='fp8': platform {platform_name} ({device}) cannot store float8_e4m3fn "
                         f"tensors ({why}); use kv_cache_dtype='auto'")


def handles_fp8(impl, platform) -> tuple[bool, str]:
    """Whether ``impl`` (of one of FP8_KV_OPS) serves an fp8 cache on ``platform``: its ``kv_fp8`` declaration."""
    if impl.id == "reference.torch":
        return True, "the reference"
    claim = getattr(impl, "kv_fp8", False)
    if callable(claim):
        try:
            ok, why = claim(platform)
        except Exception as e:  # noqa: BLE001 - a broken check costs the implementation, never the start-up
            ok, why = False, f"its fp8 check raised {type(e).__name__}: {e}"
        return bool(ok), ("" if ok else f"does not handle an fp8 KV cache here: {why}")
    return (True, "") if claim else (False, "does not handle an fp8 KV cache (kv_cache_dtype=fp8)")


def fp8_kv_args(k_scale, v_scale) -> dict:
    """The keywords a caller passes to FP8_KV_OPS: none for a cache in the model's dtype (scales None)."""
    return {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
