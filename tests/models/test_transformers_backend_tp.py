"""The transformers backend with tensor_parallel_size=2 on CPU over gloo (the mp executor: rank 0 here, rank 1
spawned) against one rank: the linear layers split per the config's base_model_tp_plan, the same greedy tokens and
logprobs, for three dense architectures and two MoE ones (whose experts stay whole on each rank; Qwen2-MoE, native
otherwise, through the backend)."""

from __future__ import annotations

import pytest

from turnout import LLM, SamplingParams
from turnout.models.transformers_backend.tiny import PROMPTS, save_tiny


def _run(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs])


@pytest.mark.parametrize("model_type", ["arcee", "gpt_neox", "cohere", "granitemoe", "qwen2_moe"])
def test_tp2_equals_tp1(model_type, tmp_path):
    hf = save_tiny(model_type, tmp_path)
    plan = getattr(hf.config, "base_model_tp_plan", None) or {}
    kw = dict(model=str(tmp_path), device="cpu", dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=16,
              model_impl="transformers")
    want_tokens, want_lps = _run(LLM(**kw))
    llm = LLM(**kw, tensor_parallel_size=2)
    model = llm.engine.executor.worker.runner.model  # rank 0, in this process
    shapes = {type(m).__name__: m.weight.shape for m in model.modules() if hasattr(m, "tp") and hasattr(m, "weight")}
    if "rowwise" in plan.values():  # the plan's rowwise layers are split (and their columnwise inputs)
        assert "RowParallelLinear" in shapes
    tokens, lps = _run(llm)
    assert tokens == want_tokens
    assert max(abs(a - b) for x, y in zip(lps, want_lps) for a, b in zip(x, y)) < 1e-4
    llm.shutdown()
