"""The gated activations a decoder's MLP picks from its config, against transformers' own functions: ``ACT2FN`` for
silu and Gemma's gelu (tanh approximation), and GPT-OSS's ``GptOssExperts._apply_gate`` for the clamped SwiGLU
(whose checkpoint interleaves gate and up columns; ours packs the gate half, then the up half). Through the op
table's default implementation here and through the Triton kernels (the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.activations import ACT2FN

from turnout.layers.activation import ClampedSwiGLU, gated_activation
from turnout.ops import Policy, resolve
from turnout.platforms.detect import detect_platform


def _tables():
    platform = detect_platform("cpu")
    tables = [pytest.param(resolve(platform), id="default")]
    ok, why = platform.triton_usable()
    tables.append(pytest.param(resolve(platform, Policy.parse("prefer=triton")) if ok else None, id="triton",
                               marks=[] if ok else pytest.mark.skip(reason=f"Triton does not run here: {why}")))
    return tables


@pytest.fixture(params=_tables())
def ops(request):
    if "triton" in request.node.callspec.id.split("-"):  # the Triton table serves every activation
        assert all(request.param.chosen(op) == "triton.default" for op in ("silu_and_mul", "gelu_tanh_and_mul",
                                                                           "clamped_swiglu"))
    return request.param


@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation_matches_hf(name, ops):
    x = torch.randn(7, 2 * 40, generator=torch.Generator().manual_seed(0)) * 3
    ours = gated_activation(name, ops)(x)
    ref = ACT2FN[name](x[:, :40]) * x[:, 40:]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_clamped_swiglu_matches_gpt_oss(ops):
    config = transformers.GptOssConfig(hidden_size=16, intermediate_size=40, num_local_experts=2,
                                       swiglu_limit=7.0)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    interleaved = torch.randn(9, 80, generator=torch.Generator().manual_seed(1)) * 6  # past the limit both ways
    packed = torch.cat([interleaved[:, ::2], interleaved[:, 1::2]], dim=-1)  # gate half, then up half
    ours = ClampedSwiGLU(ops, alpha=experts.alpha, limit=experts.limit)(packed)
    torch.testing.assert_close(ours, experts._apply_gate(interleaved), atol=1e-5, rtol=1e-5)
