"""4-bit weights on an NVIDIA GPU: the Triton w4a16 kernels pass conformance compiled, on Qwen3-8B's projection
shapes (group 128) they equal the reference in bfloat16 at one row (the streaming kernel, split K) and at prefill
rows (the tiled GEMM), and a tiny AWQ checkpoint runs through them in bfloat16 near HF on the dequantised weights."""

from __future__ import annotations

import pytest
import torch

from fp8_checkpoints import forward_logits, make_hf
from w4_checkpoints import write_w4_checkpoint

pytestmark = pytest.mark.gpu


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from turnout.platforms import detect_platform

    return detect_platform("cuda")


def test_w4a16_passes_conformance_compiled():
    platform = _gpu()
    from turnout.ops import default_registry
    from turnout.ops.conformance import run_conformance

    results = run_conformance(default_registry(), platform, ops=["w4a16_linear"])
    assert ("w4a16_linear", "triton.default") in {(r.op, r.impl) for r in results}
    bad = [r for r in results if not r.ok]
    assert not bad, bad[:5]


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)])
@pytest.mark.parametrize("m", [1, 7, 300])
def test_qwen3_8b_shapes_equal_the_reference(n, k, m):
    _gpu()
    from turnout.ops.reference.w4a16 import random_w4, w4a16_linear
    from turnout.ops.triton.w4a16 import w4a16_linear as triton_w4a16

    gen = torch.Generator().manual_seed(n + k + m)
    qw, sz = random_w4(n, k, 128, torch.bfloat16, "cuda", gen)
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    got = triton_w4a16(x, qw, sz, 128).float()
    want = w4a16_linear(x.float(), qw, sz.float(), 128)
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


def test_awq_checkpoint_on_gpu_near_hf(tmp_path):
    platform = _gpu()
    from turnout.loader import load_model
    from turnout.ops import resolve

    ops = resolve(platform)
    assert ops.chosen("w4a16_linear") == "triton.default"
    ids = torch.randint(0, 384, (24,), generator=torch.Generator().manual_seed(3))
    ref = write_w4_checkpoint(make_hf("qwen3"), "awq", tmp_path)
    loaded = load_model(str(tmp_path), ops=ops, device="cuda", dtype="bfloat16")
    ours = forward_logits(loaded.model, loaded.hf_config, ids.cuda()).float().cpu()
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    rows = (ours - want).abs().amax(-1) / want.abs().max()
    assert rows.median() < 3e-2 and rows.max() < 0.1, rows  # bfloat16 activations and scales
