"""FP8 on an NVIDIA GPU with fp8 units (sm89+; torch._scaled_mm's row-wise path sm90+): every fp8
implementation passes conformance compiled, and the tiny fp8 checkpoints of test_fp8.py run in bfloat16 through
the chosen kernels within bfloat16 tolerance of HF on the dequantised weights (activations quantised alike)."""

from __future__ import annotations

import pytest
import torch

from fp8_checkpoints import fake_quant_activations, forward_logits, make_hf, write_fp8_checkpoint

pytestmark = pytest.mark.gpu
FP8_OPS = ("quantize_fp8", "scaled_mm", "block_scaled_mm", "fp8_linear")


def _fp8_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an NVIDIA GPU with fp8 units (sm89+)")
    from turnout.platforms import detect_platform

    return detect_platform("cuda")


def test_every_fp8_implementation_passes_conformance():
    platform = _fp8_gpu()
    from turnout.ops import default_registry
    from turnout.ops.conformance import run_conformance

    results = run_conformance(default_registry(), platform, ops=list(FP8_OPS))
    impls = {(r.op, r.impl) for r in results}
    assert {(op, "triton.default") for op in FP8_OPS} <= impls
    if torch.cuda.get_device_capability() >= (9, 0):
        assert ("scaled_mm", "vendor.cuda") in impls
    bad = [r for r in results if not r.ok]
    assert not bad, bad[:5]


@pytest.mark.parametrize("fmt", ["fp8_block", "ct_channel_token", "fp8_tensor_static", "ct_channel_weight_only"])
def test_fp8_checkpoint_on_gpu_matches_hf(fmt, tmp_path):
    platform = _fp8_gpu()
    from turnout.loader import load_model
    from turnout.ops import resolve

    ops = resolve(platform)
    assert ops.chosen("fp8_linear") == "triton.default"
    ids = torch.randint(0, 384, (24,), generator=torch.Generator().manual_seed(3))
    ref = write_fp8_checkpoint(make_hf("qwen3"), fmt, tmp_path, ids)
    fake_quant_activations(ref, fmt, tmp_path)
    loaded = load_model(str(tmp_path), ops=ops, device="cuda", dtype="bfloat16")
    ours = forward_logits(loaded.model, loaded.hf_config, ids.cuda()).float().cpu()
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    rows = (ours - want).abs().amax(-1) / want.abs().max()
    assert rows.median() < 3e-2 and rows.max() < 0.1, rows  # bfloat16 activations, fp8 rounding ties
