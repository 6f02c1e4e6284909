"""SamplingParams(prompt_logprobs=k) against HF transformers' log_softmax of the prompt (float32 tiny Qwen3 on
the CPU): every position after the first, the prompt token's logprob and rank and the top-k, with chunked
prefill on and off, async scheduling, a prefix-cache hit the request must bypass, and n > 1."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402

VOCAB = 96
PROMPTS = [[3, 17, 42, 8, 91, 5, 60], [11, 2, 77, 30],
           list(range(40, 75))]  # the last crosses two blocks of 16 (a prefix-cache hit is possible)
KW = dict(kv_cache_memory=2 << 20, enforce_eager=True, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("plp")
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    hf.save_pretrained(path, safe_serialization=True)
    return hf.eval(), str(path)


@torch.no_grad()
def _hf_prompt_logprobs(hf, prompt):
    return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)  # row p predicts token p + 1


def _check(hf, prompt, plp, k):
    assert len(plp) == len(prompt) and plp[0] is None
    lp = _hf_prompt_logprobs(hf, prompt)
    for pos in range(1, len(prompt)):
        row, tok, entry = lp[pos - 1], prompt[pos], plp[pos]
        assert entry is not None, f"position {pos} missing"
        assert abs(entry[tok].logprob - float(row[tok])) <= 1e-5, (pos, entry[tok].logprob, float(row[tok]))
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top_lp, top_ids = row.topk(k)
        for r, (t, v) in enumerate(zip(top_ids.tolist(), top_lp.tolist())):
            assert abs(entry[t].logprob - v) <= 1e-5
            if t != tok:
                assert entry[t].rank == r + 1
        assert set(entry) <= set(top_ids.tolist()) | {tok}


@pytest.mark.parametrize("engine_kw", [dict(), dict(max_num_batched_tokens=5, async_scheduling=True)],
                         ids=["whole-prompt", "chunked-async"])
def test_prompt_logprobs_equal_hf(checkpoint, engine_kw):
    hf, path = checkpoint
    llm = LLM(path, **KW, **engine_kw)
    k = 3
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=k, logprobs=1)
    outs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        _check(hf, prompt, out.prompt_logprobs, k)
        assert len(out.outputs[0].token_ids) == 3
    # k = 0: the prompt token alone at each position
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert all(list(e) == [t] for e, t in zip(out.prompt_logprobs[1:], PROMPTS[0][1:]))
    # n > 1: the prompt is prefilled once, every sample's output carries it
    out = llm.generate([PROMPTS[1]], SamplingParams(n=3, max_tokens=2, prompt_logprobs=2, seed=5),
                       use_tqdm=False)[0]
    _check(hf, PROMPTS[1], out.prompt_logprobs, 2)
    # without the field: no prompt logprobs
    assert llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None


def test_prefix_cache_hit_is_bypassed(checkpoint):
    hf, path = checkpoint
    llm = LLM(path, **KW)
    prompt = PROMPTS[2]
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], plain, use_tqdm=False)
    hit = llm.generate([prompt], plain, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 16  # the cache does serve this prompt
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    _check(hf, prompt, out.prompt_logprobs, 1)
    assert out.outputs[0].token_ids == hit.outputs[0].token_ids


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_names_the_field(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
