"""KV tiers on CPU with the embedded SmolLM2 through LLM(): swap preemption, recompute and an
ample cache give the same tokens (greedy, seeded sampling, penalties, n > 1 forks, stop strings); a
swapped-in sequence's blocks hold its KV before the forward reads them; host-tier prefix hits are counted
and give a cold run's tokens; no device or host block leaks; bad values are ValueErrors naming the field."""

from __future__ import annotations

import pytest
import torch

from turnout.engine.llm import LLM
from turnout.engine.sampling_params import SamplingParams
from turnout.worker.layer_gate import LayerGatedCaches

SMALL_KV = 8 * 737280  # 8 blocks of SmolLM2 in float32: far fewer than the requests below need at once
NO_SWAP_OPS = "swap_layer_async=vendor.cuda;swap_layer=vendor.cuda;swap_blocks=vendor"  # nothing serves them on cpu
WHOLE_CACHE = "swap_layer_async=vendor.cuda;swap_layer=vendor.cuda"  # only swap_blocks is left

PROMPTS = [f"Write a short story about the number {i}." for i in range(5)]


def _params():
    return [SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0),
            SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=7),
            SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0, repetition_penalty=1.4, presence_penalty=0.5,
                           frequency_penalty=0.3),
            SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3, n=2),
            SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0, stop=[" the"])]


def _tokens(outs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def _balanced(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "device blocks leaked"
    assert bm.swap_pool.num_free == bm.swap_pool.num_blocks, "host swap blocks leaked"
    assert not bm.swapped and not llm.engine.scheduler.swapped


@pytest.fixture(scope="module")
def cold():
    return LLM(enable_prefix_caching=False, max_num_seqs=8)


@pytest.fixture(scope="module")
def reference(cold):
    return _tokens(cold.generate(PROMPTS, _params(), use_tqdm=False))


@pytest.fixture(scope="module")
def swap():
    return LLM(kv_cache_memory=SMALL_KV, preemption_mode="swap", swap_space=0.05, max_num_seqs=8)


def test_swap_recompute_and_ample_give_identical_tokens(cold, reference, swap, caplog):
    assert cold.engine.get_stats().num_preemptions_total == 0
    got = _tokens(swap.generate(PROMPTS, _params(), use_tqdm=False))
    s = swap.engine.get_stats()
    assert s.swap_preemptions_total > 0 and s.swapped_out_blocks_total > 0
    assert s.swapped_in_blocks_total == s.swapped_out_blocks_total
    assert got == reference
    _balanced(swap)
    # auto with no swap op on this platform: recompute, said why at start-up
    with caplog.at_level("INFO", logger="turnout.worker.kv_transfer"):
        rec = LLM(kv_cache_memory=SMALL_KV, preemption_mode="auto", ops_policy=NO_SWAP_OPS, max_num_seqs=8)
    assert any("preemption by recompute" in r.getMessage() and "swap_blocks" in r.getMessage()
               for r in caplog.records)
    assert rec.engine.runner.kv_transfer.mode == "recompute"
    got = _tokens(rec.generate(PROMPTS, _params(), use_tqdm=False))
    s = rec.engine.get_stats()
    assert s.recompute_preemptions_total > 0 and s.swap_preemptions_total == 0
    assert got == reference
    _balanced(rec)


def test_swapped_blocks_are_back_before_the_forward_reads_them(swap):
    runner = swap.engine.runner
    xfer = runner.kv_transfer
    assert xfer.strategy == ("sync per layer", "swap_layer")  # cpu: no streams for the async one
    pending, checked = [], []
    orig_swap_in, orig_forward = xfer.swap_in, runner.model.forward

    def swap_in(pairs):
        pending.append(list(pairs))
        return orig_swap_in(pairs)

    def forward(input_ids, positions, kv_caches, meta):
        if pending:
            pairs = pending.pop()
            assert isinstance(kv_caches, LayerGatedCaches)
            for layer, (k, v) in enumerate(kv_caches):  # fetching a layer passes its gate, as the decoder does
                hk, hv = xfer.host_caches[layer]
                for h, d in pairs:
                    assert torch.equal(k[d], hk[h]) and torch.equal(v[d], hv[h])
            checked.append(len(pairs))
        return orig_forward(input_ids, positions, kv_caches, meta)

    xfer.swap_in, runner.model.forward = swap_in, forward
    try:
        swap.generate(PROMPTS, [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)] * 5,
                      use_tqdm=False)
    finally:
        del xfer.swap_in, runner.model.forward
    assert checked, "nothing was swapped in"
    _balanced(swap)


def test_host_tier_prefix_hits(cold):
    llm = LLM(kv_cache_memory=SMALL_KV, kv_offload_gb=0.05, ops_policy=WHOLE_CACHE, max_num_seqs=8)
    assert llm.engine.runner.kv_transfer.strategy == ("whole cache", "swap_blocks")
    base = "You are a careful assistant. " * 12  # ~ 5 full blocks shared by the two turns
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate(base + "First question: what is two plus two?", greedy, use_tqdm=False)
    for i in range(3):  # other long prompts push the shared blocks out of the 8 device blocks
        llm.generate(f"Unrelated text number {i}. " * 14, greedy, use_tqdm=False)
    assert llm.engine.get_stats().host_tier_offloaded_blocks_total > 0
    before = llm.engine.get_stats().host_tier_hit_tokens_total
    prompt = base + "Second question: what is three plus three?"
    out = llm.generate(prompt, greedy, use_tqdm=False)[0]
    s = llm.engine.get_stats()
    assert s.host_tier_hit_tokens_total - before >= 4 * 16
    assert out.num_cached_tokens >= 4 * 16
    assert _tokens([out]) == _tokens(cold.generate(prompt, greedy, use_tqdm=False))
    _balanced(llm)
    assert 0 < s.host_tier_used_blocks <= llm.engine.block_manager.host_cache.num_blocks


def test_swap_mode_refused_at_start_up_without_swap_ops():
    with pytest.raises(ValueError, match=r"preemption_mode: 'swap' cannot run: no swap op can run here.*"
                                         r"swap_layer: .*swap_blocks"):
        LLM(kv_cache_memory=SMALL_KV, preemption_mode="swap", ops_policy=NO_SWAP_OPS)


@pytest.mark.parametrize("kw, field", [({"swap_space": -1}, "swap_space"), ({"swap_space": float("nan")}, "swap_space"),
                                       ({"preemption_mode": "page"}, "preemption_mode"),
                                       ({"kv_offload_gb": -0.5}, "kv_offload_gb"),
                                       ({"preemption_mode": "swap", "swap_space": 0}, "swap_space")])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        LLM(**kw)
