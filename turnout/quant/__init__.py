"""Quantised weights (fp8; 4-bit AWQ / GPTQ / compressed-tensors checkpoints, turnout/quant/w4.py). ``linear_quant(hf_config, quantization, ops)`` and ``experts_quant(...)`` are
what the loader puts in the fusion plan (``FusionPlan.linear_quant`` / ``experts_quant``) before the model is built:
the methods the linear layers (turnout/quant/fp8.py, w4.py) and the routed MoE experts (turnout/quant/moe_fp8.py,
moe_w4.py) create their parameters and run their forward with, or None.

The arithmetic is in ops (turnout/ops/reference/fp8.py: ``quantize_fp8``, ``scaled_mm``,
``block_scaled_mm``, ``fp8_linear``; turnout/ops/reference/moe_fp8.py: ``moe_experts_fp8``), called by name through
the op table, so a platform without fp8 matrix units runs the dequantising references, and the start-up line says
which implementation serves each.
"""

from __future__ import annotations

import logging

from turnout.quant.config import METHODS, Fp8Config, experts_config, has_experts, quant_config
from turnout.quant.w4_config import W4Config

logger = logging.getLogger(__name__)

__all__ = ["METHODS", "Fp8Config", "W4Config", "experts_quant", "linear_quant", "quant_config"]

FP8_OPS = ("quantize_fp8", "scaled_mm", "block_scaled_mm", "fp8_linear", "moe_experts_fp8")


def _served_by(ops, op: str) -> str:
    res = ops.resolutions.get(op)
    if res is None or res.chosen is None:
        return f"{op}: none"
    skipped = [f"{c.impl} ({c.reason})" for c in res.candidates if c.impl != res.chosen and not c.available
               and c.impl != "reference.torch"]
    return f"{op}: {res.chosen}" + (f" [skipped {'; '.join(skipped)}]" if skipped else "")


def linear_quant(hf_config, quantization: str | None, ops):
    """The linear-layer quantisation method for this model and op table (None: unquantised); ValueError
    naming ``quantization`` / the ``quantization_config`` field that cannot be served. Logs once which
    implementation runs each fp8 op, and why the faster ones do not (no fp8 units: the dequantising
    fallback)."""
    from turnout.quant.fp8 import make_method

    cfg = quant_config(hf_config, quantization)
    if cfg is None:
        return None
    if isinstance(cfg, W4Config):
        from turnout.quant.w4 import W4LinearMethod

        logger.info("quantization %s; %s", cfg.describe(), _served_by(ops, "w4a16_linear"))
        return W4LinearMethod(cfg)
    method = make_method(cfg, ops)
    used = ["fp8_linear"] if cfg.activations == "none" else \
        ["quantize_fp8", "block_scaled_mm" if cfg.weights == "block" else "scaled_mm"] + \
        (["fp8_linear"] if method.weight_only_rows else [])
    logger.info("quantization %s; %s%s", cfg.describe(), ", ".join(_served_by(ops, op) for op in used),
                "; one-row inputs weight-only (fp8_linear)" if method.weight_only_rows else "")
    return method


def experts_quant(hf_config, quantization: str | None, ops):
    """The routed experts' quantisation method (None: unquantised, or a model without experts); ValueError naming
    the field of a layout the experts cannot take (``quant_config``). Logs which implementation runs
    ``moe_experts_fp8``."""
    from turnout.quant.moe_fp8 import Fp8MoeMethod

    cfg = quant_config(hf_config, quantization)
    if cfg is None or not has_experts(hf_config):
        return None
    if isinstance(cfg, W4Config):  # the experts in 4 bits too (turnout/quant/moe_w4.py)
        from turnout.quant.moe_w4 import W4MoeMethod

        logger.info("quantization of the MoE experts: %s; %s", cfg.describe(), _served_by(ops, "moe_experts_w4a16"))
        return W4MoeMethod(cfg)
    method = Fp8MoeMethod(experts_config(cfg))
    logger.info("quantization of the MoE experts: %s; %s", method.describe(), _served_by(ops, "moe_experts_fp8"))
    return method
