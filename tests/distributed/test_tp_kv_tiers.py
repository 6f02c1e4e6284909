"""KV tiers under tensor parallelism on CPU over gloo: with tensor_parallel_size=2 (rank 1 spawned) every
rank swaps its own shard of each block, driven by the driver's step messages. Swap preemption under a KV budget that
forces it, and host-tier prefix hits after device eviction, give the tokens and logprobs of one rank with an ample
cache; the ranks' host caches hold the same blocks (each its heads)."""

from __future__ import annotations

import pytest
import torch

from turnout import LLM, SamplingParams

# 2 layers x (k, v) x 16 tokens x 1 KV head (of 2, split over 2 ranks) x 16 dims x 4 bytes
BLOCK = 2 * 2 * 16 * 1 * 16 * 4


def _prompts(n=6, length=40):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 320, (length + 5 * i,), generator=g).tolist() for i in range(n)]


def _run(llm, prompts, n=24):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t] if isinstance(lp[t], float) else lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                                     o.outputs[0].token_ids)]
             for o in outs])


def _same(got, want):
    assert got[0] == want[0]
    worst = max(abs(a - b) for x, y in zip(got[1], want[1]) for a, b in zip(x, y))
    assert worst < 1e-4, worst


KW = dict(device="cpu", max_num_batched_tokens=64, max_num_seqs=6, seed=0)


@pytest.fixture(scope="module")
def ample(tiny_path):
    return _run(LLM(tiny_path, kv_cache_memory=4 << 20, **KW), _prompts())


def test_swap_preemption_under_tp2_matches_one_rank(tiny_path, ample):
    # 6 sequences of 40..65 + 24 tokens need ~30 blocks at once: 12 force preemptions
    llm = LLM(tiny_path, tensor_parallel_size=2, kv_cache_memory=12 * BLOCK, preemption_mode="swap", swap_space=0.01,
              **KW)
    try:
        assert llm.engine.runner.kv_transfer.mode == "swap"
        got = _run(llm, _prompts())
        s = llm.get_stats()
        assert s.swap_preemptions_total > 0 and s.swapped_in_blocks_total == s.swapped_out_blocks_total > 0
        assert s.recompute_preemptions_total == 0
        _same(got, ample)
        blocks = llm.engine.executor.collective_rpc(_host_blocks)
        assert blocks[0] == blocks[1] and blocks[0][0] > 0  # each rank sized the same host pool
    finally:
        llm.engine.executor.shutdown()


def test_host_tier_under_tp2_hits_and_matches(tiny_path):
    shared = _prompts(1, 96)[0]
    others = _prompts(4, 60)
    cold = LLM(tiny_path, kv_cache_memory=4 << 20, enable_prefix_caching=False, **KW)
    want = _run(cold, [shared + [7, 8]], n=8)
    llm = LLM(tiny_path, tensor_parallel_size=2, kv_cache_memory=10 * BLOCK, kv_offload_gb=0.001, **KW)
    try:
        _run(llm, [shared + [1, 2]], n=4)
        _run(llm, others, n=4)  # pushes the shared prefix's blocks out of the 10 device blocks, to the host tier
        before = llm.get_stats().host_tier_hit_tokens_total
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        out = llm.generate([shared + [7, 8]], params, use_tqdm=False)[0]
        assert llm.get_stats().host_tier_hit_tokens_total - before >= 4 * 16 and out.num_cached_tokens >= 4 * 16
        got = ([out.outputs[0].token_ids],
               [[lp[t] if isinstance(lp[t], float) else lp[t].logprob
                 for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]])
        _same(got, want)
    finally:
        llm.engine.executor.shutdown()


def _host_blocks(worker):
    xfer = worker.runner.kv_transfer
    return xfer.num_swap_blocks, xfer.num_offload_blocks, worker.runner.num_kv_heads
