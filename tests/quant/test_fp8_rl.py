"""RL weight updates of an fp8 model (through the RL control plane): a trainer holds float weights, the
rollout engine runs ``quantization="fp8"``. ``LLM.update_weights`` with the trainer's float tensors must leave the
engine exactly where a fresh engine built from the same float weights starts (the loaders quantise what they are
sent), for a dense model (per-channel scales) and a Qwen3-MoE (experts in 128 x 128 blocks), also after
sleep(level=2) / wake_up; a tensor that is already fp8 is refused naming it, rather than written as if it were
float."""

from __future__ import annotations

import pytest
import torch

from fp8_checkpoints import make_hf
from fp8_moe_checkpoints import make_moe_hf
from turnout import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 7], [250, 11, 8, 64, 2, 30, 31, 9]]


def _run(llm):
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, p, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob if not isinstance(lp[t], float) else lp[t]
                                      for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]


@pytest.mark.parametrize("make", [lambda seed: make_hf("qwen3", seed=seed), make_moe_hf], ids=["dense", "moe"])
def test_float_update_of_an_fp8_engine_equals_a_fresh_one(make, tmp_path):
    before, after = make(0), make(1)
    d0, d1 = tmp_path / "before", tmp_path / "after"
    before.save_pretrained(d0, safe_serialization=True)
    after.save_pretrained(d1, safe_serialization=True)
    kw = dict(device="cpu", quantization="fp8", max_model_len=64, seed=0)
    llm = LLM(str(d0), **kw)
    old = _run(llm)
    written = llm.update_weights(after.named_parameters())
    assert written
    new = _run(llm)
    fresh = _run(LLM(str(d1), **kw))
    assert new == fresh  # the same float weights quantised the same way: bit for bit
    assert new != old
    name, w = next((n, p) for n, p in before.named_parameters() if n.endswith("q_proj.weight"))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        llm.update_weights([(name, w.to(torch.float8_e4m3fn))])  # fp8 from the trainer: not taken as float
    assert _run(llm) == fresh  # all or nothing: the refused update wrote nothing
    llm.sleep(level=2)  # the hybrid loop: weights discarded, then the trainer's (here: the first) float weights
    llm.wake_up()
    llm.update_weights(before.named_parameters())
    assert _run(llm) == old
