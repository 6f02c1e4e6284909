"""FP8 MoE experts on an NVIDIA GPU with fp8 units (sm89+): the Triton ``moe_experts_fp8`` compiled passes the op's
conformance on every path and at Qwen3-30B-A3B's expert shapes in bfloat16, replays from a CUDA graph, and the
tiny fp8 Qwen3-MoE of test_fp8_moe.py runs in bfloat16 near HF on the dequantised weights (activations quantised
alike; only a gross error fails there, as in test_fp8_gpu.py: fp8 rounding flips of bf16 activations)."""

from __future__ import annotations

import pytest
import torch

from fp8_checkpoints import forward_logits
from fp8_moe_checkpoints import make_moe_hf, quantize_activations_like_fp8, write_fp8_moe_checkpoint

pytestmark = pytest.mark.gpu


def _fp8_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an NVIDIA GPU with fp8 units (sm89+)")
    from turnout.platforms import detect_platform

    return detect_platform("cuda")


@pytest.mark.parametrize("kernel", ["auto", "grouped", "decode"])
def test_every_path_passes_conformance(kernel):
    platform = _fp8_gpu()
    from turnout.ops import Policy, default_registry
    from turnout.ops.conformance import run_conformance

    policy = Policy.parse(f"moe_experts_fp8.kernel={kernel}", source="TURNOUT_OPS")
    results = run_conformance(default_registry(), platform, ops=["moe_experts_fp8"], policy=policy)
    assert {r.impl for r in results} == {"triton.default"}
    bad = [(r.dtype, r.case, r.message) for r in results if not r.ok]
    assert not bad, bad


@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_qwen3_30b_expert_shapes_in_bf16_and_graph_replay(tokens):
    """E 128, H 2048, I 768, top-8 (the decode paths up to T 64, the grouped GEMM at 300), against the reference with
    the op's own bound; the same call captured in a CUDA graph and replayed on new inputs equals eager."""
    _fp8_gpu()
    from turnout.ops.conformance import run_case
    from turnout.ops.reference.moe_fp8 import MOE_EXPERTS_FP8, make_experts
    from turnout.ops.spec import SampleCase
    from turnout.ops.triton.moe_fp8 import moe_experts_fp8

    gen = torch.Generator().manual_seed(tokens)
    experts = make_experts(128, 2048, 768, gen, "cuda")
    x = torch.randn(tokens, 2048, generator=gen).cuda().bfloat16()
    ids = torch.rand(tokens, 128, generator=gen).topk(8, dim=1).indices.to(torch.int32).cuda()
    weights = (torch.rand(tokens, 8, generator=gen) / 4).cuda()
    ok, err, msg = run_case(MOE_EXPERTS_FP8, moe_experts_fp8, SampleCase("qwen3_30b", (x, *experts, weights, ids)),
                            "bfloat16")
    assert ok, msg
    moe_experts_fp8(x, *experts, weights, ids)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_fp8(x, *experts, weights, ids)
    x.copy_(torch.randn(tokens, 2048, generator=gen).cuda().bfloat16())
    ids.copy_(torch.rand(tokens, 128, generator=gen).topk(8, dim=1).indices.to(torch.int32).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_experts_fp8(x, *experts, weights, ids))


def test_fp8_moe_checkpoint_on_gpu_matches_hf(tmp_path):
    platform = _fp8_gpu()
    from turnout.loader import load_model
    from turnout.ops import resolve

    ops = resolve(platform)
    assert ops.chosen("moe_experts_fp8") == "triton.default"
    ids = torch.randint(0, 384, (24,), generator=torch.Generator().manual_seed(3))
    ref = write_fp8_moe_checkpoint(make_moe_hf(), tmp_path)
    quantize_activations_like_fp8(ref)
    loaded = load_model(str(tmp_path), ops=ops, device="cuda", dtype="bfloat16")
    for n in (24, 1):  # the grouped or decode path at prefill, the one-token kernel
        ours = forward_logits(loaded.model, loaded.hf_config, ids[:n].cuda()).float().cpu()
        with torch.no_grad():
            want = ref(ids[:n][None]).logits[0]
        rows = (ours - want).abs().amax(-1) / want.abs().max()
        assert rows.median() < 0.15 and rows.max() < 0.25, (n, rows)
