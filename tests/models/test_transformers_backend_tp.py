"""The transformers backend with tensor_parallel_size=2 on CPU over gloo (the mp executor: rank 0 here, rank 1
spawned) against one rank: the same greedy tokens and logprobs, for three dense architectures and four MoE ones
(Qwen2-MoE, native otherwise, through the backend; once with expert parallelism). Each rank holds only its share:
the linear layers split per the config's base_model_tp_plan, the MoE experts' stacks (through moe_experts) split by
the intermediate dim or by expert id, and the vocab-parallel embedding and head, counted in bytes on both ranks."""

from __future__ import annotations

import pytest

from turnout import LLM, SamplingParams
from turnout.models.transformers_backend.model import rank_weight_bytes
from turnout.models.transformers_backend.tiny import PROMPTS, save_tiny


def _run(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs])


@pytest.mark.parametrize("model_type,ep", [("arcee", False), ("gpt_neox", False), ("cohere", False),
                                           ("granitemoe", False), ("qwen2_moe", False), ("olmoe", False),
                                           ("qwen2_moe", True)])
def test_tp2_equals_tp1(model_type, ep, tmp_path):
    hf = save_tiny(model_type, tmp_path)
    plan = getattr(hf.config, "base_model_tp_plan", None) or {}
    # the plan's styles for linear layers (5.17's plans also name the experts' stacks, which experts.py splits)
    linear_styles = {style for name, style in plan.items() if ".experts" not in name}
    kw = dict(model=str(tmp_path), device="cpu", dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=16,
              model_impl="transformers")
    with LLM(**kw) as one:
        whole = one.collective_rpc(rank_weight_bytes)[0]
        want_tokens, want_lps = _run(one)
    with LLM(**kw, tensor_parallel_size=2, enable_expert_parallel=ep) as llm:
        model = llm.engine.executor.worker.runner.model  # rank 0, in this process
        kinds = {type(m).__name__ for m in model.modules() if hasattr(m, "tp") and hasattr(m, "weight")}
        if "rowwise" in linear_styles:  # the plan's rowwise layers are split (and their columnwise inputs)
            assert "RowParallelLinear" in kinds
        per_rank = llm.collective_rpc(rank_weight_bytes)
        tokens, lps = _run(llm)
    assert len(per_rank) == 2
    for rank in per_rank:  # the vocabulary (128 rows) and the experts split evenly: half of one rank's bytes each
        assert rank["vocab"] * 2 == whole["vocab"] > 0
        assert rank["experts"] * 2 == whole["experts"]
        if {"colwise", "rowwise"} & linear_styles:  # (OLMoE's plan gathers every split again: whole here)
            assert rank["other"] < whole["other"]
    assert (whole["experts"] > 0) == ("moe" in model_type)
    assert tokens == want_tokens
    assert max(abs(a - b) for x, y in zip(lps, want_lps) for a, b in zip(x, y)) < 1e-4
