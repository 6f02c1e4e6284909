"""4-bit MoE experts on an NVIDIA GPU (not run yet: no GPU in the session that wrote them): the Triton
moe_experts_w4a16 passes conformance compiled; on Qwen3-30B-A3B's expert shapes (E 128, H 2048, I 768, top-8, group
128) it equals the reference in bfloat16 at one token, a decode batch and a prefill, also replayed from a CUDA graph;
a tiny GPTQ Qwen3-MoE runs through it in bfloat16 near HF on the dequantised weights."""

from __future__ import annotations

import pytest
import torch

from fp8_checkpoints import forward_logits
from w4_moe_checkpoints import make_hf, write_w4_moe_checkpoint

pytestmark = pytest.mark.gpu


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from turnout.platforms import detect_platform

    return detect_platform("cuda")


def test_moe_w4a16_passes_conformance_compiled():
    platform = _gpu()
    from turnout.ops import default_registry
    from turnout.ops.conformance import run_conformance

    results = run_conformance(default_registry(), platform, ops=["moe_experts_w4a16"])
    assert ("moe_experts_w4a16", "triton.default") in {(r.op, r.impl) for r in results}
    bad = [r for r in results if not r.ok]
    assert not bad, bad[:5]


def _layer(t: int, seed: int):
    from turnout.ops.reference.moe import _routing
    from turnout.ops.reference.moe_w4a16 import random_experts

    gen = torch.Generator().manual_seed(seed)
    stacks = random_experts(128, 2048, 768, 128, torch.bfloat16, "cuda", gen)
    weights, ids = _routing(t, 128, 8, "cuda", gen)
    return (torch.randn(t, 2048, generator=gen) * 0.5).to("cuda", torch.bfloat16), *stacks, weights, ids, 128


@pytest.mark.parametrize("t", [1, 16, 700])
def test_qwen3_30b_a3b_expert_shapes_equal_the_reference(t):
    _gpu()
    from turnout.ops.reference.moe_w4a16 import moe_experts_w4a16 as reference
    from turnout.ops.triton.moe_w4a16 import moe_experts_w4a16

    args = _layer(t, t)
    got = moe_experts_w4a16(*args).float()
    x, q13, s13, q2, s2, w, ids, g = args
    want = reference(x.float(), q13, s13.float(), q2, s2.float(), w, ids, g)
    assert ((got - want).abs().max() / want.abs().max()).item() < 3e-2
    graph = torch.cuda.CUDAGraph()  # the engine replays decode steps from graphs: no host sync inside
    with torch.cuda.graph(graph):
        replayed = moe_experts_w4a16(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed.float(), got)


def test_gptq_moe_checkpoint_on_gpu_near_hf(tmp_path):
    platform = _gpu()
    from turnout.loader import load_model
    from turnout.ops import resolve

    ops = resolve(platform)
    assert ops.chosen("moe_experts_w4a16") == "triton.default"
    ids = torch.randint(0, 384, (24,), generator=torch.Generator().manual_seed(3))
    ref = write_w4_moe_checkpoint(make_hf("qwen3_moe"), "qwen3_moe", "gptq", tmp_path)
    loaded = load_model(str(tmp_path), ops=ops, device="cuda", dtype="bfloat16")
    ours = forward_logits(loaded.model, loaded.hf_config, ids.cuda()).float().cpu()
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    rows = (ours - want).abs().amax(-1) / want.abs().max()
    assert rows.median() < 3e-2 and rows.max() < 0.1, rows  # bfloat16 activations and scales
