"""The transformers backend's probes and the 4-bit dummy draw under a device context that is not the CPU.

On the GPU the model is built under ``torch.device("cuda")``, so a bare ``torch.randn(..., generator=cpu_gen)``
lands on the GPU and raises ("Expected a 'cuda' device type for generator"): every architecture of the
backend and every dummy w4a16 load failed on the H100 (2026-12-07) while passing here. The meta device stands in
for the GPU: under it, each probe must still draw its inputs on the CPU and give the CPU's answer."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from turnout.models.transformers_backend.build import _norm_kind
from turnout.models.transformers_backend.experts import _gate_is_silu_and_mul
from turnout.quant.w4 import _dummy_q


def test_norm_probe_under_another_device_context():
    norm = LlamaRMSNorm(8)
    want = _norm_kind(norm)
    assert want is False  # rms_norm with w, not 1 + w
    with torch.device("meta"):
        assert _norm_kind(norm) is want


def test_gate_probe_under_another_device_context():
    experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4,
                                             num_experts_per_tok=2))
    assert _gate_is_silu_and_mul(experts, 8)
    with torch.device("meta"):
        assert _gate_is_silu_and_mul(experts, 8)


def test_w4_dummy_draw_follows_the_generator():
    want, got = (torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.uint8), requires_grad=False) for _ in range(2))
    _dummy_q(want, torch.Generator().manual_seed(0), 0.02)
    assert int(want.max()) > 0
    with torch.device("meta"):  # the parameter and the generator on the CPU, the context elsewhere
        _dummy_q(got, torch.Generator().manual_seed(0), 0.02)
    assert torch.equal(got, want)
