"""`turnout serve -dp 2`: two engine replicas (a process each) behind one server. Concurrent requests reach both
replicas (the per-replica metrics say so), seeded outputs equal the one-engine (DP=1) LLM's, the totals are
the replicas' sums; the router's load and prefix rules; SIGKILL of the server leaves no replica behind."""

from __future__ import annotations

import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_helpers import Serve, gone, save_tiny
from turnout.engine.dp import PREFIX_SLACK, Router


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_dp"))


def _prompts():
    return [[3 + i, 7, 9 + i, 11] for i in range(8)]


def _metric(text, name, replica=None) -> float:
    label = "" if replica is None else rf'\{{replica="{replica}"\}}'
    return float(re.search(rf"^{name}{label} ([0-9.eE+-]+)$", text, re.M).group(1))


def test_dp2_serves_on_both_replicas_and_matches_dp1(tiny, tmp_path):
    from turnout import LLM, SamplingParams

    srv = Serve(tiny, "-dp", "2", "--seed", "0", log_dir=tmp_path).wait_healthy()
    try:
        pids = [p.pid for p in srv.descendants()]

        def complete(i_prompt):
            i, prompt = i_prompt
            r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 16, "temperature": 1.0, "seed": 100 + i, "ignore_eos": True,
                "logprobs": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["tokens"]

        with ThreadPoolExecutor(8) as pool:
            served = list(pool.map(complete, enumerate(_prompts())))
        text = httpx.get(srv.url + "/metrics", timeout=5).text
        per = [_metric(text, "turnout_replica_generation_tokens_total", r) for r in (0, 1)]
        assert min(per) > 0, per  # both replicas generated
        assert _metric(text, "turnout_generation_tokens_total") == sum(per) == 8 * 16
        assert sum(_metric(text, "turnout_replica_requests_total", r) for r in (0, 1)) == 8

        srv.proc.send_signal(signal.SIGKILL)  # no drain, no atexit: the replicas must still go
        srv.proc.wait(10)
        assert gone(pids) == [], srv.log()
    finally:
        srv.kill()

    llm = LLM(tiny, device="cpu", dtype="float32", kv_cache_memory=8 << 20)  # one engine, the same seeds
    tok = llm.get_tokenizer()
    outs = llm.generate(_prompts(), [SamplingParams(max_tokens=16, temperature=1.0, seed=100 + i, ignore_eos=True)
                                     for i in range(8)], use_tqdm=False)
    assert served == [[tok.decode([t]) for t in o.outputs[0].token_ids] for o in outs]


def test_router_least_load_and_prefix_stickiness():
    r = Router(2)
    short = [1, 2, 3]
    assert r.pick([3, 1], short) == 1 and r.pick([0, 0], short) == 0  # no prefix key: the least loaded
    long = list(range(40))
    assert r.pick([1, 0], long) == 1  # first seen: the least loaded, remembered
    assert r.pick([0, PREFIX_SLACK], long + [7]) == 1  # same first 32 tokens: back to it, within the slack
    assert r.pick([0, PREFIX_SLACK + 1], long) == 0  # too loaded: the least loaded, which it now sticks to
    assert r.pick([1, 0], long) == 0
