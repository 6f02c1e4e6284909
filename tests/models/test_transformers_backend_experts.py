"""MoE experts of transformers models through turnout's ``moe_experts`` op by transformers' experts interface
(turnout/models/transformers_backend/experts.py), against HF transformers on the same tiny random float32 weights:
last-position logits of three prompts within 1e-4 with the op's calls counted by an implementation registered in
the dispatch layer (the reference's own computation, ranked first), and greedy tokens of the engine for 32 tokens.
The experts' own python loop of transformers never runs: every routed output is the op's."""

from __future__ import annotations

import pytest
import torch

from turnout import LLM, SamplingParams
from turnout.entrypoints.models_check import LOGITS_TOLERANCE, _prefill_last_logits
from turnout.loader import load_model
from turnout.models.transformers_backend.experts import experts_reason, is_experts_module
from turnout.models.transformers_backend.tiny import PROMPTS, hf_greedy, save_tiny
from turnout.ops import Policy, resolve
from turnout.ops.reference.moe import moe_experts as reference_moe_experts
from turnout.ops.registry import build_registry
from turnout.ops.spec import Impl
from turnout.platforms import detect_platform


class CountedMoeExperts:
    """An implementation of ``moe_experts`` that counts its calls and computes as the reference does."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return reference_moe_experts(*args, **kwargs)


def _counted_ops():
    counted = CountedMoeExperts()
    registry = build_registry(plugins=False)
    registry.add_impl(Impl("moe_experts", "vendor.counted", counted, priority=100))
    platform = detect_platform("cpu")
    ops = resolve(platform, Policy.from_sources(None, platform=platform), registry=registry)
    assert ops.chosen("moe_experts") == "vendor.counted"
    return ops, counted


# Families whose stacked experts class goes through the interface (afmoe: dense first layer; qwen2_moe: a shared
# expert; granitemoeshared: a shared MLP; mixtral, qwen3_moe: native families run through the backend here).
@pytest.mark.parametrize("model_type", ["olmoe", "qwen2_moe", "mixtral", "granitemoeshared", "afmoe", "phimoe"])
def test_experts_through_the_op_equal_hf(model_type, tmp_path):
    hf = save_tiny(model_type, tmp_path)
    n_experts = sum(is_experts_module(m) for m in hf.modules())
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0, -1].float() for p in PROMPTS]
    ops, counted = _counted_ops()
    model = load_model(str(tmp_path), device="cpu", ops=ops, dtype="float32", model_impl="transformers").model
    assert model.experts_through_op == n_experts > 0, model.experts_kept
    counted.calls = 0  # (the build's probe forward called it too)
    got = _prefill_last_logits(model, PROMPTS, torch.device("cpu"), torch.float32)
    assert counted.calls == n_experts  # one batched prefill: each experts module once, through the op
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    assert diff <= LOGITS_TOLERANCE, f"{model_type}: logits differ by {diff:.2e}"
    names = model.transformers_modules()  # the start-up line's "still transformers code" leaves the experts out
    assert not any(type(m).__name__ in names for m in model.modules() if is_experts_module(m))


@pytest.mark.parametrize("model_type", ["qwen3_moe"])  # olmoe, granitemoe(shared): test_transformers_backend.py
def test_greedy_tokens_through_the_op_equal_hf(model_type, tmp_path):
    hf = save_tiny(model_type, tmp_path)
    want = [hf_greedy(hf, p, 32)[0] for p in PROMPTS]
    llm = LLM(model=str(tmp_path), model_impl="transformers", device="cpu", dtype="float32",
              kv_cache_memory=8 << 20)
    assert llm.engine.executor.worker.runner.model.experts_through_op > 0
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_experts_the_op_does_not_compute_stay_transformers_code(tmp_path):
    """GPT-OSS's experts have biases and a clamped gate: named, kept whole, and still equal to HF."""
    hf = save_tiny("gpt_oss", tmp_path)
    experts = next(m for m in hf.modules() if is_experts_module(m))
    assert "has biases" in experts_reason(experts)
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0, -1].float() for p in PROMPTS]
    ops, counted = _counted_ops()
    model = load_model(str(tmp_path), device="cpu", ops=ops, dtype="float32", model_impl="transformers").model
    assert model.experts_through_op == 0 and "has biases" in model.experts_kept
    got = _prefill_last_logits(model, PROMPTS, torch.device("cpu"), torch.float32)
    assert counted.calls == 0
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= LOGITS_TOLERANCE


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_rank_loads_its_part_of_stacked_and_per_expert_tensors(expert_parallel):
    """Rank 1 of 2: a transformers-5 stacked tensor and the per-expert gate / up / down tensors of a checkpoint
    land as the same part: rows [3, 6) of each expert's gate and of its up and those columns of its down (tensor
    parallel), or experts 2 and 3 whole (expert parallel)."""
    from turnout.distributed.parallel_state import TPGroup
    from turnout.models.transformers_backend.experts import ExpertsShard

    e, h, i = 4, 8, 6
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    holder = torch.nn.Module()
    holder.down_proj = torch.nn.Parameter(torch.empty(e, h, i, device="meta"))
    shard = ExpertsShard(e, h, i, ops=None, tp=TPGroup(rank=1, size=2, group=object()), expert_parallel=expert_parallel)
    shard.make_parameters(holder)
    if expert_parallel:
        want_gu, want_d = gate_up[2:], down[2:]
    else:
        want_gu, want_d = torch.cat([gate_up[:, 3:6], gate_up[:, i + 3:]], 1), down[:, :, 3:]
    for load in ("stacked", "per_expert"):
        gu = torch.nn.Parameter(torch.zeros(holder.gate_up_proj.shape), requires_grad=False)
        d = torch.nn.Parameter(torch.zeros(holder.down_proj.shape), requires_grad=False)
        with torch.no_grad():
            if load == "stacked":
                holder.gate_up_proj.weight_loader(gu, gate_up)
                holder.down_proj.weight_loader(d, down)
            else:
                for x in range(e):
                    holder.gate_up_proj.load_expert(gu, gate_up[x, :i], x, 0, 2)
                    holder.gate_up_proj.load_expert(gu, gate_up[x, i:], x, 1, 2)
                    holder.down_proj.load_expert(d, down[x], x, 0, 1)
        assert torch.equal(gu, want_gu) and torch.equal(d, want_d), load
    with pytest.raises(ValueError, match="gate_up_proj"):
        holder.gate_up_proj.load_expert(gu, gate_up[0], 0, 0, 2)  # a [2I, H] tensor where a gate [I, H] belongs


def test_weight_update_of_a_stacked_experts_tensor(tmp_path):
    """An RL weight update names the stacked experts as transformers 5 does; it lands in the op's stack."""
    hf = save_tiny("olmoe", tmp_path)
    llm = LLM(model=str(tmp_path), model_impl="transformers", device="cpu", dtype="float32", kv_cache_memory=4 << 20)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    before = hf_greedy(hf, PROMPTS[0], 8)[0]
    new = torch.randn_like(hf.get_parameter(name)) * 0.3
    llm.update_weights({name: new})
    with torch.no_grad():
        hf.get_parameter(name).copy_(new)
    want = hf_greedy(hf, PROMPTS[0], 8)[0]
    assert want != before  # the update changes the tokens
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == want
