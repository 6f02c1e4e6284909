"""A swap implementation that raises on its first call is replaced by the next swap op and the copy is
redone from its untouched source (worker/kv_transfer.py): through the real engine on CPU with the
embedded SmolLM2, a fake vendor whose swap ops scribble NaN into the destination blocks and then raise,
and outputs that must equal an ample cache's (so no request is lost or corrupted).

The CPU has no device streams, so ``swap_layer_async`` is never chosen here; the test registry lifts
that op's stream requirement so the fake async implementation is chosen and fails on its first call, as
a broken vendor kernel on a GPU would (tests/kv/test_kv_tiers_gpu.py does the same on CUDA)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from turnout.engine.llm import LLM
from turnout.engine.sampling_params import SamplingParams
from turnout.ops import Impl, build_registry
from turnout.ops import registry as registry_mod

SMALL_KV = 8 * 737280  # 8 blocks of SmolLM2 in float32: the five requests below must be preempted
PROMPTS = [f"Write a short story about the number {i}." for i in range(5)]
PARAMS = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0),
          SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=7),
          SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3, n=2),
          SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0, repetition_penalty=1.3),
          SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0, stop=[" the"])]


class BrokenSwap:
    """A vendor swap kernel that writes part of its output (NaN into the destination blocks) and raises."""

    def __init__(self):
        self.calls = 0

    def __call__(self, src, dst, block_mapping, stream=None):
        self.calls += 1
        for d in dst:
            d[block_mapping[:, 1].long().to(d.device)] = float("nan")
        raise RuntimeError("fakeswap: DMA engine not initialised")


def _tokens(outs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(enable_prefix_caching=False, max_num_seqs=8)
    return _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))


@pytest.fixture
def fake_vendor(monkeypatch):
    """The process-wide registry replaced, for this test, by the built-ins plus vendor.fakeswap."""
    reg = build_registry(plugins=False)
    reg.ops["swap_layer_async"] = dataclasses.replace(reg.ops["swap_layer_async"], requires=None)
    broken = {op: BrokenSwap() for op in ("swap_layer_async", "swap_layer")}

    def register(view):
        for op, fn in broken.items():
            view.add_impl(Impl(op=op, id="vendor.fakeswap", target=fn, platforms=("cpu",)))

    assert reg.run_registration("fakeswap", register, source="plugin:fakeswap")
    monkeypatch.setattr(registry_mod, "_default", reg)
    return broken


@pytest.mark.parametrize("policy, first, after", [
    ("swap_layer_async=vendor.fakeswap", ("async per layer", "swap_layer_async"), ("sync per layer", "swap_layer")),
    ("swap_layer_async=vendor.fakeswap;swap_layer=vendor.fakeswap", ("async per layer", "swap_layer_async"),
     ("whole cache", "swap_blocks")),
])
def test_a_swap_op_failing_on_first_use_is_replaced(fake_vendor, reference, policy, first, after, caplog):
    llm = LLM(kv_cache_memory=SMALL_KV, preemption_mode="swap", swap_space=0.05, max_num_seqs=8, ops_policy=policy)
    xfer = llm.engine.runner.kv_transfer
    assert xfer.strategy == first
    with caplog.at_level(logging.WARNING, logger="turnout.worker.kv_transfer"):
        got = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    s = llm.engine.get_stats()
    assert s.swap_preemptions_total > 0 and s.swapped_in_blocks_total == s.swapped_out_blocks_total > 0
    assert s.num_failed_requests_total == 0
    assert got == reference  # the NaN the broken calls left in the blocks was overwritten by the redo
    assert xfer.strategy == after
    failed = [op for op, fn in fake_vendor.items() if fn.calls]
    assert sorted(xfer.failed) == sorted(failed) and all(fake_vendor[op].calls == 1 for op in failed)
    assert all("DMA engine not initialised" in why for why in xfer.failed.values())
    warned = [r.getMessage() for r in caplog.records if "failed on its first call" in r.getMessage()]
    assert len(warned) == len(failed) and all(any(op in w for w in warned) for op in failed)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.swap_pool.num_free == bm.swap_pool.num_blocks
    for k, v in llm.engine.runner.kv_caches:  # no NaN left where a later request could read it
        assert not torch.isnan(k).any() and not torch.isnan(v).any()

