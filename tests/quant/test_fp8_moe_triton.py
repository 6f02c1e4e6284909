"""The tiny fp8 Qwen3-MoE of test_fp8_moe.py through the Triton fp8 kernels (TRITON_INTERPRET=1 on CPU): the grouped
GEMM at prefill, the decode kernels for a few rows, the one-token kernel for one, each equal to the reference ops'
model (an activation at an fp8 rounding tie may round the other way, as in test_fp8.py: see the test)."""

from __future__ import annotations

import pytest
import torch

from fp8_checkpoints import forward_logits
from fp8_moe_checkpoints import make_moe_hf, write_fp8_moe_checkpoint
from turnout import envs
from turnout.loader import load_model
from turnout.ops import Policy, resolve
from turnout.platforms.detect import detect_platform

pytestmark = pytest.mark.skipif(not envs.get().triton_interpret, reason="needs TRITON_INTERPRET=1 (CPU)")

FP8_TRITON = ";".join(f"{op}=triton.default" for op in ("quantize_fp8", "block_scaled_mm", "fp8_linear",
                                                          "moe_experts_fp8"))


def test_triton_fp8_moe_model_equals_the_reference_ops(tmp_path):
    platform = detect_platform("cpu")
    triton_ops = resolve(platform, Policy.from_sources(FP8_TRITON, env={}, platform=platform))
    assert triton_ops.chosen("moe_experts_fp8") == "triton.default"
    write_fp8_moe_checkpoint(make_moe_hf(num_experts=4), tmp_path)
    ours = load_model(str(tmp_path), ops=triton_ops, device="cpu")
    plain = load_model(str(tmp_path), ops=resolve(platform), device="cpu")
    assert plain.model.model.layers[0].mlp.experts.quant_ops.chosen("moe_experts_fp8") == "reference.torch"
    # One-row inputs of the dense layers take the weight-only fp8_linear in the Triton table (it declares it pays);
    # the reference table is told the same, so that only the experts' implementation differs.
    assert ours.model.model.layers[1].mlp.down_proj.quant.weight_only_rows == 1
    plain.model.model.layers[1].mlp.down_proj.quant.weight_only_rows = 1
    ids = torch.randint(0, 384, (40,), generator=torch.Generator().manual_seed(2))
    for n in (40, 3, 1):  # 80 pairs of 4 experts: the grouped GEMM; 6: decode; 1 token: the one-token kernel
        got = forward_logits(ours.model, ours.hf_config, ids[:n])
        want = forward_logits(plain.model, plain.hf_config, ids[:n])
        rows = (got - want).abs().amax(-1) / want.abs().max()
        # A flip (an activation a hair from an fp8 rounding tie, rounded the other way after float32 sums in another
        # order) at token p moves token p and, through attention, every later one, never an earlier one: the
        # exact rows are a prefix. Where it lands depends on the machine's BLAS (token 19 of 40 with OpenBLAS 0.3.31
        # on an AMD EPYC), so the prefix must hold a quarter of the rows, and no row may move more than a flip does.
        exact = rows < 1e-5
        prefix = int(exact.int().cumprod(0).sum())
        assert bool(exact[:prefix].all()) and not bool(exact[prefix:].any()), (n, rows)
        assert prefix >= max(1, n // 4) and rows.max() < 0.05, (n, rows)
