"""The whole engine (paged KV, chunked prefill, prefix caching, continuous batching) against HF
transformers on the same weights: tiny random Llama, Qwen2 and Qwen3 models, float32 on CPU."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402

ARCHS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False),
}
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg = ARCHS[request.param]()
    model = getattr(transformers, CLASSES[request.param])(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so that a missed norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d, safe_serialization=True)
    return request.param, str(d), model


def _prompts():
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 320, (40,), generator=g).tolist()  # a prefix shared by three prompts
    return [shared + torch.randint(0, 320, (n,), generator=g).tolist() for n in (3, 17, 29)] + \
           [torch.randint(0, 320, (n,), generator=g).tolist() for n in (1, 9, 70)]


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
        logits = model(out).logits[0, len(prompt) - 1: -1]  # the logits that chose each new token
    return out[0, len(prompt):].tolist(), logits


def test_logits_and_greedy_match_hf(tiny):
    arch, path, hf = tiny
    # chunked prefill (budget 24 tokens/step), prefix caching, 6 prompts batched together
    llm = LLM(path, max_num_batched_tokens=24, max_num_seqs=4, kv_cache_memory=8 << 20,
              enable_prefix_caching=True)
    captured = []
    model = llm.engine.runner.model
    orig = model.compute_logits

    def capture(hidden):
        out = orig(hidden)
        captured.append(out.clone())
        return out

    model.compute_logits = capture
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_prefix_cached_tokens > 0, "the shared prefix should hit the prefix cache"
    for prompt, out in zip(prompts, outs):
        want_tokens, want_logits = _hf_greedy(hf, prompt, 32)
        got = out.outputs[0]
        assert got.token_ids == want_tokens, f"{arch}: greedy tokens differ from HF"
        # the engine's logprob of each chosen token = log_softmax of its logits row
        want_lp = torch.log_softmax(want_logits.float(), -1).gather(1, torch.tensor(want_tokens)[:, None])[:, 0]
        got_lp = torch.tensor([next(iter(d.values())).logprob for d in got.logprobs])
        torch.testing.assert_close(got_lp, want_lp, rtol=1e-4, atol=1e-4)
    # and the raw logit rows, matched to HF by content (the batch order differs)
    hf_rows = torch.cat([_hf_greedy(hf, p, 32)[1] for p in prompts])
    got_rows = torch.cat(captured)
    assert got_rows.shape[0] >= hf_rows.shape[0]
    for row in hf_rows[:: 7]:
        err = ((got_rows - row).abs().amax(-1) / row.abs().amax()).min()
        assert err < 1e-4, f"{arch}: no engine logits row within 1e-4 relative of HF's ({err:.2e})"


def test_preemption_gives_the_same_greedy_outputs(tiny):
    _, path, _ = tiny
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ample = LLM(path, kv_cache_memory=8 << 20).generate(prompts, params)
    # room for about 12 blocks of 16 tokens: several requests get preempted and recomputed
    tiny_llm = LLM(path, kv_cache_memory=None, max_num_batched_tokens=32)
    tiny_llm.engine.block_manager.__init__(12, 16, True)
    small = tiny_llm.generate(prompts, params)
    assert tiny_llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in ample]


def test_seeded_sampling_is_batch_invariant(tiny):
    _, path, _ = tiny
    llm = LLM(path, kv_cache_memory=8 << 20)
    prompts = _prompts()
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate(prompts[2], p)[0].outputs[0].token_ids
    crowd = llm.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 2 + [p] +
                         [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 3)
    assert crowd[2].outputs[0].token_ids == alone


def test_n_samples_share_prompt_blocks(tiny):
    _, path, _ = tiny
    llm = LLM(path, kv_cache_memory=8 << 20)
    out = llm.generate(_prompts()[5], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True))
    seqs = [c.token_ids for c in out[0].outputs]
    assert len(seqs) == 4 and all(len(s) == 8 for s in seqs)
    assert len({tuple(s) for s in seqs}) > 1, "4 seeded samples should not all be equal"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_sliding_window_models_serve_their_full_context(tmp_path):
    """A Mistral whose layers declare a window serves its whole context (the window is applied by the attention
    ops and its blocks released), and generating past the window gives HF's greedy tokens."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                     sliding_window=48)
    hf = transformers.MistralForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20)
    assert llm.engine.max_model_len == 512
    prompt = list(range(1, 41))
    got = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].outputs[0].token_ids
    assert got == _hf_greedy(hf, prompt, 30)[0]
    with pytest.raises(ValueError, match="maximum context length is 512"):
        llm.generate([i % 300 + 1 for i in range(500)], SamplingParams(max_tokens=20))
