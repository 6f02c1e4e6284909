"""The fusion plan: which fused kernels a model's batch-1 decode path uses, chosen once, before it is built.

A decode step at batch 1 is a chain of small kernels, and three fused ops replace parts of that chain:

* ``one_row_linear``: every one-row projection (linear layers, MoE routers, the LM head) goes through
  ``small_m_linear`` instead of ``F.linear`` (the Triton kernel streams each weight row once);
* ``prenorm_linear``: a decoder layer's two pre-norms are computed inside the first one-row projection that
  reads each (``add_rms_norm_linear``, ``PendingNorm`` in turnout/layers/norm.py), for the projection
  shapes ``prenorm_pays(N, K)`` allows; only with ``one_row_linear`` (it is that projection's kernel);
* ``rope_attention``: q/k norm, RoPE, the cache write and attention in one decode kernel
  (``rotary_paged_attention``).

``plan_fusions(ops)`` derives the plan from the frozen op table: a fusion applies where the platform is a
GPU and the implementation the table chose for its op declares that it pays (``Impl.pays``,
turnout/ops/spec.py): the engine never asks a kernel module. The plan goes to the model constructor
(``cls(config, ops, plan)``), and each layer picks its forward from it when it is built; nothing is
attached to a layer afterwards. Calls go through the op table by name, so a first-call fallback
(turnout/ops/dispatch.py) still applies.

Not in the plan: CPU linear weights stored K-major (``turnout.layers.linear.use_k_major_weights``). That
is a re-layout of loaded weights, the same ``F.linear`` on the same values, and it has to follow loading
(weight loaders and the dummy initialiser fill row-major tensors): the model runner applies it once,
after the load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FusionPlan:
    one_row_linear: bool = False
    prenorm_linear: bool = False
    prenorm_pays: Callable[[int, int], bool] | None = None  # (N, K) of a projection -> fuse there; None: all
    rope_attention: bool = False
    # Batch-invariant mode (turnout/ops/batch_invariant.py): every projection, whatever its rows, goes through
    # the ``linear`` op (a fixed reduction order), and nothing above is fused (the fused paths are chosen by
    # batch size, so a row's arithmetic would change with the batch).
    all_linear: bool = False
    # Not a fusion: how the quantizable linear layers hold and multiply their weights (turnout/quant; None:
    # in the compute dtype). Set by the loader from the checkpoint or EngineConfig.quantization.
    linear_quant: object | None = None
    # Likewise for the routed MoE experts (turnout/quant/moe_fp8.py; None: in the compute dtype).
    experts_quant: object | None = None
    # Not a fusion either: latent attention's prefill (turnout/layers/mla_prefill.py), auto | absorbed |
    # decompressed; from TURNOUT_MLA_PREFILL on every platform
    mla_prefill: str = "auto"

    def __post_init__(self):
        if self.all_linear and (self.one_row_linear or self.rope_attention):
            raise ValueError("FusionPlan: all_linear (batch-invariant mode) takes no batch-size-chosen fusion")
        if self.prenorm_linear and not self.one_row_linear:
            raise ValueError("FusionPlan: prenorm_linear needs one_row_linear (the fused kernel is the one-row "
                             "projection's)")
        from turnout.layers.mla_prefill import MLA_PREFILL_MODES

        if self.mla_prefill not in MLA_PREFILL_MODES:
            raise ValueError(f"FusionPlan: mla_prefill {self.mla_prefill!r}: expected one of "
                             f"{', '.join(MLA_PREFILL_MODES)}")

    def fuses_prenorm(self, n: int, k: int) -> bool:
        """Whether a one-row projection of weight [n, k] computes a pending pre-norm itself."""
        return self.prenorm_linear and (self.prenorm_pays is None or bool(self.prenorm_pays(n, k)))

    def describe(self) -> str:
        on = [name for name in ("one_row_linear", "prenorm_linear", "rope_attention", "all_linear")
              if getattr(self, name)]
        return ", ".join(on) or "none"


NO_FUSIONS = FusionPlan()


def _claim(ops, op: str) -> Callable[..., bool] | None:
    """The pays predicate the implementation chosen for ``op`` declares (None: no claim, or no such op)."""
    impl = ops.chosen_impl(op) if op in ops.resolutions else None
    if impl is None:
        return None
    try:
        return impl.pays_predicate()
    except Exception as e:  # a broken claim costs the fusion, never the start-up
        logger.warning("fusion plan: %s of %s: %s; not fused", impl.id, op, e)
        return None


def plan_fusions(ops, rope_attention: bool | None = None) -> FusionPlan:
    """The plan for a model run with op table ``ops``. ``rope_attention``: None reads TURNOUT_ROPE_ATTENTION
    (turnout.envs); False keeps q/k norm, RoPE and the cache write outside the attention kernel. Under a
    batch-invariant policy: ``all_linear`` and nothing else, on every platform. ``mla_prefill``: always
    TURNOUT_MLA_PREFILL's."""
    from turnout import envs

    mla_prefill = envs.get().mla_prefill
    if getattr(ops.policy, "batch_invariant", False):
        return FusionPlan(all_linear=True, mla_prefill=mla_prefill)
    if not ops.platform.is_gpu:  # on the host the fused kernels are the Triton interpreter's: tests only
        return FusionPlan(mla_prefill=mla_prefill)
    if rope_attention is None:
        rope_attention = envs.get().rope_attention
    one_row = _claim(ops, "small_m_linear")
    prenorm = _claim(ops, "add_rms_norm_linear") if one_row is not None else None
    rope = _claim(ops, "rotary_paged_attention") if rope_attention else None
    return FusionPlan(one_row_linear=one_row is not None, prenorm_linear=prenorm is not None, prenorm_pays=prenorm,
                      rope_attention=rope is not None, mla_prefill=mla_prefill)
