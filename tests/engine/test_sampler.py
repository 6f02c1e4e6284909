"""The sampler never lets a value a request carries hit the wrong token or overflow a tensor dtype: token
ids outside the vocabulary ban and count nothing (they used to wrap onto real tokens), and the model
runner makes every lane value fit its tensor even for values that bypassed admission."""

import pytest
import torch

from turnout.layers.sampler import SamplingBatch, apply_penalties

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402

V = 8


def _batch(**kw):
    one = torch.ones(1)
    return SamplingBatch(rows=torch.zeros(1, dtype=torch.long), temperature=one, top_k=torch.zeros(1, dtype=torch.int32),
                         top_p=one, min_p=torch.zeros(1), seeds=torch.zeros(1, dtype=torch.long),
                         steps=torch.zeros(1, dtype=torch.long), **kw)


def test_out_of_vocabulary_banned_ids_ban_nothing():
    logits = torch.arange(V, dtype=torch.float32)[None]
    # V + 1 used to land on token 0 (% (V + 1)), 2V + 2 on token 0 again, -5 on token 4; V is the pad column
    got = apply_penalties(logits, _batch(banned=torch.tensor([[V + 1, 2 * V + 2, V, -1, -5, 3]])))
    want = logits.clone()
    want[0, 3] = float("-inf")
    assert torch.equal(got, want)


def test_out_of_vocabulary_history_ids_count_nothing():
    logits = torch.ones(1, V)
    b = _batch(output_ids=torch.tensor([[V + 1, 2, -1, 10 * V]]), prompt_ids=torch.tensor([[V + 2, -1]]),
               presence=torch.tensor([1.0]), frequency=torch.tensor([0.0]), repetition=torch.tensor([1.0]))
    got = apply_penalties(logits, b)
    want = torch.ones(1, V)
    want[0, 2] = 0.0  # only the real token 2 was seen
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    d = tmp_path_factory.mktemp("llama_sampler")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    return LLM(str(d), kv_cache_memory=2 << 20)


def _generate(engine, params, mutate=None):
    engine.add_request("x", [1, 2, 3], params)
    if mutate is not None:  # past admission: what a bug there, or a caller poking at the params, would leave
        mutate(params)
    toks = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                toks = out.outputs[0].token_ids
    return toks


def test_values_that_bypassed_admission_never_overflow_a_tensor(llm):
    engine = llm.engine
    base = _generate(engine, SamplingParams(temperature=0.9, seed=3, max_tokens=6, min_tokens=6, ignore_eos=True))

    def poke(p):
        p.top_k = 2**40  # int32 overflow; above the vocabulary = off
        p.stop_token_ids = [64, 65, 2**70]  # outside the vocabulary (2**70 is past int64): ban nothing

    got = _generate(engine, SamplingParams(temperature=0.9, seed=3, max_tokens=6, min_tokens=6, ignore_eos=True), poke)
    assert got == base


def test_a_64_bit_seed_is_served_and_reproducible(llm):
    engine = llm.engine
    a = _generate(engine, SamplingParams(temperature=1.0, seed=2**64 - 1, max_tokens=8, ignore_eos=True))
    b = _generate(engine, SamplingParams(temperature=1.0, seed=2**64 - 1, max_tokens=8, ignore_eos=True))
    assert a == b and len(a) == 8


def test_logit_bias_applies_to_its_request_only(llm):
    engine = llm.engine
    plain = SamplingParams(temperature=1.0, seed=4, max_tokens=6, ignore_eos=True)
    base = _generate(engine, plain)
    engine.add_request("biased", [1, 2, 3], SamplingParams(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True,
                                                           logit_bias={7: 100.0, 8: -100.0}))
    engine.add_request("plain", [1, 2, 3], SamplingParams(temperature=1.0, seed=4, max_tokens=6, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["biased"] == [7] * 6
    assert done["plain"] == base
    a = _generate(engine, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={8: -100.0}))
    assert 8 not in a


def test_out_of_vocabulary_bias_ids_bias_nothing(llm):
    engine = llm.engine
    base = _generate(engine, SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True))

    def poke(p):
        p.logit_bias = {64: 100.0, 65 + 64: 100.0, 2**70: 100.0}  # 129 would wrap onto token 0 mod 65

    got = _generate(engine, SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True), poke)
    assert got == base
