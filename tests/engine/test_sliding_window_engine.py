"""A tiny Mistral (every layer a sliding window of 16 tokens) served by the whole engine far past its window,
against transformers on the same weights: greedy tokens equal to HF's and every step's top logprobs within 1e-4
of HF's log-softmax over the same tokens, at TP=1 and TP=2 (gloo, a process per extra rank). Meanwhile the block
manager releases the blocks that fall out of the window: no sequence ever holds more than ceil(16 / 4) + 1
blocks while it decodes, and the cache given (24 blocks) is smaller than the two sequences' full lengths
(2 x 23 blocks) would need. Before the cache followed the layers' specs, such a model was capped at its
window (16 tokens), so these requests were refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from turnout import LLM, SamplingParams

WINDOW, BS, STEPS = 16, 4, 70
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # layers x (k, v) x tokens x kv heads x head dim x float32


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=512, sliding_window=WINDOW, rms_norm_eps=1e-6,
                                     tie_word_embeddings=False)
    # no EOS: HF's generate holds an EOS back below min_new_tokens, while the engine ignores it (ignore_eos)
    cfg.eos_token_id = None
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + noise if "norm" in name else noise)
    path = tmp_path_factory.mktemp("mistral")
    hf.save_pretrained(path, safe_serialization=True)
    return str(path), hf


def _prompts():
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 256, (9,), generator=g).tolist()  # a shared prefix: prefix-cache hits
    return [shared + torch.randint(0, 256, (3,), generator=g).tolist(), shared + [7]]


@pytest.fixture(scope="module")
def hf_reference(mistral):
    """Per prompt: HF's greedy tokens, and its log-softmax over prompt + those tokens at each drawn position."""
    _, hf = mistral
    out = []
    with torch.no_grad():
        for p in _prompts():
            ids = torch.tensor([p])
            tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=STEPS,
                                 min_new_tokens=STEPS)[0, len(p):].tolist()
            logits = hf(torch.tensor([p + tokens])).logits[0, len(p) - 1: -1]
            out.append((tokens, torch.log_softmax(logits.double(), -1)))
    return out


def _generate(llm):
    """Greedy, 5 logprobs a token, stepping the engine to watch each sequence's blocks."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    for i, p in enumerate(_prompts()):
        eng.add_request(str(i), p, params)
    bm, most, done = eng.block_manager, 0, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
        for seq in eng.scheduler.running:
            if seq.num_computed_tokens > len(seq.prompt_token_ids):  # decoding
                most = max(most, len(bm.live_blocks(seq)))
    return [done[str(i)] for i in range(len(_prompts()))], most, bm


def _check(outs, hf_reference):
    for out, (tokens, ref_lp) in zip(outs, hf_reference):
        assert out.token_ids == tokens
        assert len(set(tokens)) > STEPS // 6  # a varied continuation, so equal tokens say something
        for i, lp in enumerate(out.logprobs):
            for tok, entry in lp.items():
                got = entry if isinstance(entry, float) else entry.logprob
                assert abs(got - float(ref_lp[i, tok])) < 1e-4, (i, tok)


KW = dict(device="cpu", block_size=BS, max_num_batched_tokens=8, max_num_seqs=2,
          enable_prefix_caching=True, dtype="float32")


@pytest.mark.parametrize("tp", [1, 2])
def test_mistral_far_past_its_window_matches_hf_with_bounded_blocks(mistral, hf_reference, tp):
    path, _ = mistral
    llm = LLM(path, tensor_parallel_size=tp, kv_cache_memory=24 * BLOCK_BYTES // tp, **KW)  # per rank: its heads
    try:
        assert llm.engine.max_model_len == 512  # no cap at the window
        assert llm.engine.runner.cache_layout.window == WINDOW and llm.engine.runner.num_blocks == 24
        outs, most, bm = _generate(llm)
    finally:
        llm.engine.executor.shutdown()
    _check(outs, hf_reference)
    assert most <= -(-WINDOW // BS) + 1
    assert bm.num_window_released > 2 * (STEPS // BS) - 12
    assert llm.engine.scheduler.num_prefix_cached_tokens > 0
