"""KV tiers on a GPU: the per-layer async swap op is chosen (the Triton kernel that reads pinned
host memory in place, on a side stream; the DMA one of vendor.cuda when the policy says so) and
swap preemption, recompute and an ample cache give the same greedy tokens (dummy Qwen3-0.6B in float32,
CUDA graphs on, so swap-ins pass both the layer gates and the graph replay's gate); host-tier prefix hits
after device eviction give a cold run's tokens; an async swap implementation that raises on its first
call is replaced by the sync one and no request is lost; the overlap measurement runs on device events."""

from __future__ import annotations

import os

import pytest
import torch

from turnout import LLM, SamplingParams
from turnout.ops import Impl, build_registry
from turnout.ops import registry as registry_mod

pytestmark = pytest.mark.gpu

CFG = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs", "qwen3-0.6b")
KW = dict(load_format="dummy", dtype="float32", max_model_len=512, seed=0)
BLOCK = 28 * 2 * 16 * 8 * 128 * 4  # Qwen3-0.6B, float32: layers x (k, v) x block x kv heads x head_dim x 4
SMALL_KV = 24 * BLOCK  # 8 sequences of 100 + 48 tokens need 80 blocks


def _prompts(n=8, length=100):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(10, 150000, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def _greedy(llm, prompts, n=48):
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]


def _same(got, want):
    diverged = [(i, next(j for j, (a, b) in enumerate(zip(x, y)) if a != b)) for i, (x, y) in enumerate(zip(got, want))
                if x != y]
    assert not diverged, f"(sequence, first differing token) {diverged}"


@pytest.fixture(scope="module")
def ample():
    llm = LLM(CFG, gpu_memory_utilization=0.3, **KW)
    toks = _greedy(llm, _prompts())
    assert llm.get_stats().num_preemptions_total == 0
    del llm
    torch.cuda.empty_cache()
    return toks


@pytest.mark.parametrize("mode,impl", [("swap", "triton.default"), ("swap", "vendor.cuda"),
                                       ("recompute", "triton.default")])
def test_swap_and_recompute_equal_an_ample_cache(ample, mode, impl):
    pol = None if impl == "triton.default" else f"swap_layer_async={impl};swap_layer={impl}"
    llm = LLM(CFG, kv_cache_memory=SMALL_KV, preemption_mode=mode, swap_space=1, ops_policy=pol, **KW)
    xfer = llm.engine.runner.kv_transfer
    assert xfer.strategy == ("async per layer", "swap_layer_async")
    assert llm.engine.ops.chosen("swap_layer_async") == impl  # triton.default by default (UVA kernel)
    _same(_greedy(llm, _prompts()), ample)
    s = llm.get_stats()
    assert s.num_preemptions_total > 0
    if mode == "swap":
        assert s.swap_preemptions_total > 0 and s.swapped_in_blocks_total == s.swapped_out_blocks_total > 0
    else:
        assert s.swap_preemptions_total == 0
    assert not xfer.failed


def test_host_tier_hits_after_device_eviction():
    llm = LLM(CFG, kv_cache_memory=SMALL_KV, kv_offload_gb=0.5, **KW)
    shared = _prompts(1, 160)[0]
    _greedy(llm, [shared + [11, 12]], n=4)
    _greedy(llm, _prompts(4, 120), n=4)  # pushes the shared blocks out of the 24 device blocks
    assert llm.get_stats().host_tier_offloaded_blocks_total > 0
    before = llm.get_stats().host_tier_hit_tokens_total
    prompt = shared + [13, 14]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert llm.get_stats().host_tier_hit_tokens_total - before >= 9 * 16 and out.num_cached_tokens >= 9 * 16
    cold = LLM(CFG, gpu_memory_utilization=0.2, enable_prefix_caching=False, **KW)
    _same([out.outputs[0].token_ids], _greedy(cold, [prompt], n=16))


def test_overlap_measurement_runs_on_device_events():
    llm = LLM(CFG, kv_cache_memory=256 * BLOCK, kv_offload_gb=0.5, **KW)
    r = llm.engine.runner.kv_transfer.measure_overlap(num_blocks=64, tokens=512)
    print("overlap", r)
    assert r["hidden"] is not None and 0.0 <= r["hidden"] <= 1.0 and r["copy_ms"] > 0 and r["forward_ms"] > 0
    assert r["blocks"] == 64


def test_async_swap_failing_on_first_use_falls_back_to_sync(ample, monkeypatch):
    calls = []

    def broken(src, dst, block_mapping, stream=None):
        calls.append(1)
        for d in dst:
            d[block_mapping[:, 1].long().to(d.device)] = float("nan")  # a partial write, then the failure
        raise RuntimeError("fakeswap: no kernel image for this device")

    reg = build_registry(plugins=False)
    reg.run_registration("fakeswap", lambda view: view.add_impl(
        Impl(op="swap_layer_async", id="vendor.fakeswap", target=broken, platforms=("cuda",))), source="plugin:fakeswap")
    monkeypatch.setattr(registry_mod, "_default", reg)
    llm = LLM(CFG, kv_cache_memory=SMALL_KV, preemption_mode="swap", swap_space=1,
              ops_policy="swap_layer_async=vendor.fakeswap", **KW)
    xfer = llm.engine.runner.kv_transfer
    assert xfer.strategy == ("async per layer", "swap_layer_async")
    _same(_greedy(llm, _prompts()), ample)
    assert calls == [1] and list(xfer.failed) == ["swap_layer_async"]
    assert xfer.strategy == ("sync per layer", "swap_layer")
    assert llm.get_stats().num_failed_requests_total == 0
    for k, v in llm.engine.runner.kv_caches:
        assert not torch.isnan(k).any() and not torch.isnan(v).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_triton_swap_kernel_moves_scattered_blocks_both_ways(dtype):
    from turnout.ops.triton.swap import swap_layer, swap_layer_async

    g = torch.Generator().manual_seed(0)
    dev = [torch.randn((64, 16, 8, 128), generator=g).to("cuda", dtype) for _ in range(4)]
    host = [torch.zeros((48, 16, 8, 128), dtype=dtype, pin_memory=True) for _ in range(4)]
    out = torch.tensor([[5, 40], [63, 0], [6, 41], [17, 3]])  # scattered device blocks -> host blocks
    swap_layer(dev, host, out)
    torch.cuda.synchronize()
    for d, h in zip(dev, host):
        for a, b in out.tolist():
            assert torch.equal(h[b].view(torch.uint8), d[a].cpu().view(torch.uint8))
        assert not h[1].view(torch.uint8).any()  # nothing else written
    back = torch.tensor([[40, 7], [0, 60], [3, 33]])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    event = swap_layer_async(host, dev, back, stream=side)
    torch.cuda.current_stream().wait_event(event)
    for d, h in zip(dev, host):
        for a, b in back.tolist():
            assert torch.equal(d[b].cpu().view(torch.uint8), h[a].view(torch.uint8))
    pageable = [torch.zeros((48, 16, 8, 128), dtype=dtype) for _ in range(4)]  # not addressable: staged copy
    swap_layer(dev, pageable, out)
    for d, h in zip(dev, pageable):
        assert torch.equal(h[40].view(torch.uint8), d[5].cpu().view(torch.uint8))
