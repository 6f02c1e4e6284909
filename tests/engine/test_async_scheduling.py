"""Async scheduling (a decode step launched before the previous step's tokens are read back) must give
exactly what the synchronous engine gives: same tokens, finish reasons, logprobs and seeded samples,
through early stops, preemption, aborts, prefix caching, n > 1 and penalties. On CPU the device work is
synchronous, so these tests check the bookkeeping; the GPU is where the overlap pays."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("qwen3_async")
    model.save_pretrained(d, safe_serialization=True)
    return str(d)


def _prompts():
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 96, (20,), generator=g).tolist()
    return [shared + torch.randint(0, 96, (n,), generator=g).tolist() for n in (2, 11)] + \
           [torch.randint(0, 96, (n,), generator=g).tolist() for n in (1, 6, 33)]


def _pair(path, **kw):
    return (LLM(path, kv_cache_memory=4 << 20, async_scheduling=False, **kw),
            LLM(path, kv_cache_memory=4 << 20, async_scheduling=True, **kw))


def _summary(outs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob) for c in o.outputs]
            for o in outs]


def _check_same(sync, asy, prompts, params):
    want = sync.generate(prompts, params)
    got = asy.generate(prompts, params)
    assert _summary(got) == _summary(want)
    for llm in (sync, asy):
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks, "every block is free once all requests ended"
    return want


def test_greedy_with_mixed_lengths_and_early_stop_tokens(tiny):
    sync, asy = _pair(tiny)
    prompts = _prompts()
    base = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    stop_tok = base[0].outputs[0].token_ids[4]  # a token the model emits: several requests stop early
    params = [SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=[stop_tok]) for n in (20, 3, 17, 1, 25)]
    lookahead_before = asy.engine.num_lookahead_steps
    want = _check_same(sync, asy, prompts, params)
    assert asy.engine.num_lookahead_steps > lookahead_before, "async scheduling never launched ahead"
    assert sync.engine.num_lookahead_steps == 0
    assert any(o.outputs[0].finish_reason == "stop" for o in want)
    assert any(o.outputs[0].finish_reason == "length" for o in want)


def test_seeded_sampling_logprobs_min_tokens_and_n(tiny):
    sync, asy = _pair(tiny)
    prompts = _prompts()
    stop_tok = sync.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].token_ids[2]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=15, logprobs=3),
              SamplingParams(temperature=0.8, top_k=20, seed=12, max_tokens=12, min_tokens=6, stop_token_ids=[stop_tok]),
              SamplingParams(n=3, temperature=1.0, seed=13, max_tokens=9),
              SamplingParams(temperature=0.0, max_tokens=14, logprobs=2),
              SamplingParams(temperature=1.0, seed=14, max_tokens=18, min_tokens=18, stop_token_ids=[stop_tok])]
    _check_same(sync, asy, prompts, params)


def test_penalties_fall_back_to_synchronous_steps(tiny):
    sync, asy = _pair(tiny)
    params = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.2)
    before = asy.engine.num_lookahead_steps
    _check_same(sync, asy, _prompts(), params)
    assert asy.engine.num_lookahead_steps == before


def test_preemption_and_prefix_cache_hits(tiny):
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ample = LLM(tiny, kv_cache_memory=4 << 20, async_scheduling=False).generate(prompts, params)
    small = LLM(tiny, kv_cache_memory=None, max_num_batched_tokens=24, async_scheduling=True)
    small.engine.block_manager.__init__(10, 16, True)
    got = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ample]
    # a second pass over the same prompts hits the prefix cache that the async steps registered
    hits = small.engine.scheduler.num_prefix_cached_tokens
    again = small.generate(prompts, params)
    assert small.engine.scheduler.num_prefix_cached_tokens > hits
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ample]


def test_abort_and_streaming_outputs(tiny):
    sync, asy = _pair(tiny)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = []
    for llm in (sync, asy):
        eng = llm.engine
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        streamed: dict[str, list[int]] = {}
        finished = {}
        steps = 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                assert not out.finished or out.request_id not in finished
                streamed.setdefault(out.request_id, [])
                new = out.outputs[0].token_ids
                assert new[:len(streamed[out.request_id])] == streamed[out.request_id]  # grows, never rewrites
                streamed[out.request_id] = list(new)
                if out.finished:
                    finished[out.request_id] = list(new)
            steps += 1
            if steps == 5:
                eng.abort_request("r2")
        bm = eng.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert "r2" not in finished and len(finished) == len(prompts) - 1
        results.append(finished)
    assert results[0] == results[1]
