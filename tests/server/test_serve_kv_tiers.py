"""KV tiers behind a real `turnout serve`: the embedded SmolLM2 on CPU with a KV cache of 8 blocks, swap
preemption and a host prefix tier. Concurrent streamed and plain requests through the official openai client get the
texts an ample-cache engine gives; /metrics reports the swaps and the host-tier hits (turnout_swap_preemptions_total,
turnout_swapped_in/out_blocks_total, turnout_host_tier_hit_tokens_total, turnout_prefix_cache_hit_tokens_total)."""

from __future__ import annotations

import concurrent.futures as cf
import re

import httpx
import pytest

from conftest import ServerProcess
from turnout import LLM, SamplingParams

openai = pytest.importorskip("openai")

BLOCK = 737280  # one KV block of SmolLM2-135M in float32 (30 layers x k, v x 16 tokens x 3 heads x 64 x 4 bytes)
PROMPTS = [f"Write a short story about the number {i}." for i in range(5)]
SHARED = "You are a careful assistant. " * 12  # ~70 tokens: several full blocks


def _metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(turnout_[a-z_]+) ([0-9.e+-]+)$", text, re.M)}


@pytest.fixture(scope="module")
def tier_server():
    srv = ServerProcess("--kv-cache-memory", str(8 * BLOCK), "--preemption-mode", "swap", "--swap-space", "0.05",
                        "--kv-offload-gb", "0.05", "--max-num-seqs", "8", "--max-model-len", "512", "--seed", "0")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def test_swapped_requests_get_an_ample_cache_texts(tier_server):
    want = [o.outputs[0].text for o in LLM(max_num_seqs=8).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
    client = openai.OpenAI(base_url=f"{tier_server.base_url}/v1", api_key="unused")

    def ask(i: int) -> str:
        if i % 2:  # streamed
            chunks = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[i], max_tokens=24,
                                               temperature=0.0, stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks)
        r = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[i], max_tokens=24,
                                      temperature=0.0, extra_body={"ignore_eos": True})
        return r.choices[0].text

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, range(len(PROMPTS))))
    assert got == want
    m = _metrics(tier_server.base_url)
    assert m["turnout_swap_preemptions_total"] > 0 and m["turnout_recompute_preemptions_total"] == 0, m
    assert m["turnout_swapped_in_blocks_total"] == m["turnout_swapped_out_blocks_total"] > 0, m
    assert m["turnout_num_requests_swapped"] == 0


def test_host_tier_hits_show_in_metrics(tier_server):
    client = openai.OpenAI(base_url=f"{tier_server.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id

    def complete(prompt: str) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0.0).choices[0].text

    first = complete(SHARED + "Say hi.")
    for i in range(3):  # unrelated prompts of ~70 tokens: the shared prefix's blocks leave the 8 device blocks
        complete(f"Count slowly from {i} to {i + 40}, one number per word, and explain each step. " * 3)
    before = _metrics(tier_server.base_url)
    assert before["turnout_host_tier_offloaded_blocks_total"] > 0, before
    again = complete(SHARED + "Say hi.")
    after = _metrics(tier_server.base_url)
    assert after["turnout_host_tier_hit_tokens_total"] - before["turnout_host_tier_hit_tokens_total"] >= 3 * 16, after
    assert after["turnout_prefix_cache_hit_tokens_total"] > before["turnout_prefix_cache_hit_tokens_total"]
    assert again == first
