"""An fp8 model through the Triton fp8 kernels (TRITON_INTERPRET=1 on CPU; tests/quant/test_fp8_gpu.py runs
them compiled): the tiled GEMM at prefill equals the reference ops' model, and a one-row step takes the
weight-only decode kernel (``fp8_linear`` declares it pays), which equals HF on the dequantised weights with
float activations."""

from __future__ import annotations

import pytest
import torch

from fp8_checkpoints import forward_logits, make_hf, write_fp8_checkpoint
from turnout import envs
from turnout.loader import load_model
from turnout.ops import Policy, resolve
from turnout.platforms.detect import detect_platform

pytestmark = pytest.mark.skipif(not envs.get().triton_interpret, reason="needs TRITON_INTERPRET=1 (CPU)")

FP8_TRITON = ";".join(f"{op}=triton.default" for op in ("quantize_fp8", "scaled_mm", "block_scaled_mm",
                                                          "fp8_linear"))


@pytest.mark.parametrize("fmt", ["fp8_block"])  # scaled_mm row-wise: its conformance cases
def test_triton_fp8_model_equals_the_reference_ops(fmt, tmp_path):
    platform = detect_platform("cpu")
    triton_ops = resolve(platform, Policy.from_sources(FP8_TRITON, env={}, platform=platform))
    assert triton_ops.chosen("block_scaled_mm") == "triton.default"
    ids = torch.randint(0, 384, (12,), generator=torch.Generator().manual_seed(2))
    hf = make_hf("llama")
    ref = write_fp8_checkpoint(hf, fmt, tmp_path, ids)
    ours = load_model(str(tmp_path), ops=triton_ops, device="cpu")
    assert ours.model.model.layers[0].mlp.down_proj.quant.weight_only_rows == 1
    plain = load_model(str(tmp_path), ops=resolve(platform), device="cpu")
    got, want = forward_logits(ours.model, ours.hf_config, ids), forward_logits(plain.model, plain.hf_config, ids)
    rows = (got - want).abs().amax(-1) / want.abs().max()
    assert (rows < 1e-5).float().mean() >= 0.5 and rows.max() < 0.05, rows  # rounding ties as in test_fp8.py
    one = forward_logits(ours.model, ours.hf_config, ids[:1])  # one row: weight-only, activations unquantised
    with torch.no_grad():
        exact = ref(ids[:1][None]).logits[0]
    assert ((one - exact).abs().max() / exact.abs().max()) < 1e-5
