"""Batch-invariant mode: which ops it needs, and the implementations tagged ``batch_invariant``.

``LLM(batch_invariant=True)`` / ``--batch-invariant`` adds ``invariant=all`` to the op policy
(``Policy.for_config``): each op of ``INVARIANT_OPS`` is then served only by an implementation declared
``Impl(..., batch_invariant=True)``, and an op none serves here is a start-up error that names the op, the
platform and every candidate with why it was skipped. The fusion plan then sends every projection through
the ``linear`` op and fuses nothing by batch size (turnout/layers/fusion.py).

The ops listed are every op of a forward and the sampler whose arithmetic could depend on the batch. Not
listed: the ops that only move or mask bits (cache writes and copies, swaps, the token bitmask: exact
whatever the batch) and the collectives (the mode refuses tensor parallelism: an all-reduce's summation
order depends on the message size). The sampler's logprobs (``torch.log_softmax`` per row) were measured
invariant and stay outside the table.

A vendor or plugin supplies its own by registering ``Impl(op, "vendor.x", ..., batch_invariant=True)``; the
suite in tests/ops/test_batch_invariant_ops.py runs every tagged implementation it finds on a platform
(conformance against the reference, and a row alone == the same row inside batches of 1, 3, 17, 64 rows).
"""

from __future__ import annotations

from turnout.ops.spec import TRITON_PLATFORMS, Impl

INVARIANT_OPS = ("linear", "small_m_linear", "add_rms_norm_linear", "rms_norm", "fused_add_rms_norm",
                 "rotary_embedding", "qk_norm_rotary", "qk_norm_rotary_cache", "silu_and_mul", "paged_attention",
                 "rotary_paged_attention", "moe_experts", "select_experts", "sample")

_REF = "turnout.ops.reference.batch_invariant"
# Triton: the kernels of turnout/ops/triton/batch_invariant.py (one fixed tile config, no split-K or split-KV,
# fixed-order MoE combine), and the row-wise kernels of the default set that are invariant as they are: one
# program per row (per token for rotary), launch config from the row's width only, never from the row count.
TRITON_TARGETS = {op: f"turnout.ops.triton.batch_invariant:{op}"
                  for op in ("linear", "small_m_linear", "paged_attention", "moe_experts")}
TRITON_TARGETS.update({"rms_norm": "norm:rms_norm", "fused_add_rms_norm": "norm:fused_add_rms_norm",
                       "rotary_embedding": "rotary:rotary_embedding", "qk_norm_rotary": "rotary:qk_norm_rotary",
                       "qk_norm_rotary_cache": "rotary:qk_norm_rotary_cache",
                       "silu_and_mul": "activation:silu_and_mul", "select_experts": "routing:select_experts",
                       "sample": "sampling:sample"})
TRITON_TARGETS = {op: t if t.startswith("turnout.") else f"turnout.ops.triton.{t}" for op, t in TRITON_TARGETS.items()}


# the fp8 KV cache (turnout/ops/kv_cache.py): the default Triton cache write handles it; the invariant attention
# kernel does not (its reference.batch_invariant twin serves then)
TRITON_FP8_KV = {"qk_norm_rotary_cache": True}


def specs() -> list:
    """The op this mode adds to the table: ``linear`` (turnout/ops/reference/matmul.py)."""
    from turnout.ops.reference.matmul import LINEAR

    return [LINEAR]


def _triton_check(platform):
    return platform.triton_usable()


def _triton_fp8_kv(platform):
    from turnout.ops.triton import fp8_kv_check

    return fp8_kv_check(platform)


def register(view) -> None:
    """Built-in batch-invariant implementations. Outside the mode nothing changes: they rank below every other
    implementation of their family (priority), and the Triton ones below the reference too (``below``, which
    the dispatch ignores for an op under ``invariant=``), so the default order picks what it picked before."""
    for op in INVARIANT_OPS:
        view.add_impl(Impl(op=op, id="reference.batch_invariant", target=f"{_REF}:{op}", priority=-2000,
                           batch_invariant=True, kv_fp8=True))  # fp8 caches: dequantised element-wise first
    for op, target in TRITON_TARGETS.items():
        view.add_impl(Impl(op=op, id="triton.batch_invariant", target=target,
                           platforms=(TRITON_PLATFORMS,), priority=-2000, check=_triton_check, below=("reference",),
                           batch_invariant=True, kv_fp8=_triton_fp8_kv if TRITON_FP8_KV.get(op) else False))
