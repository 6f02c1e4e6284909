"""The Ray executor on a local Ray instance on this machine (loopback only; CPU, gloo, TP=2): rank 0 in this
process, rank 1 a Ray actor in the engine's placement group. Greedy tokens and logprobs equal one rank's,
through chunked prefill and prefix caching; collective_rpc reaches both ranks; shutdown leaves no actor
process, no placement group and (the executor started it) no Ray instance. Without Ray, asking for it is a
ValueError that says how to install it."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from tiny_tok_model import write_tiny_model  # tests/distributed is on sys.path
from turnout import LLM, SamplingParams

KW = dict(device="cpu", kv_cache_memory=4 << 20, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)


def _prompts():
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 320, (20,), generator=g).tolist()  # a prefix shared by two prompts
    return [shared + [5, 6, 7], shared + torch.randint(0, 320, (9,), generator=g).tolist(),
            torch.randint(0, 320, (30,), generator=g).tolist(), [42]]


def _run(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_ray"))


def test_ray_tp2_matches_tp1(tiny, monkeypatch):
    # before Ray is imported: its local instance on 127.0.0.1 (else on this machine's routable address)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'turnout[ray]'); the Ray executor "
                                            "test needs it")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the actors' gloo pairs on loopback too (they inherit it)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ref_tokens, ref_lps = _run(LLM(tiny, **KW))
    assert not ray.is_initialized()
    llm = LLM(tiny, tensor_parallel_size=2, distributed_executor_backend="ray", **KW)
    executor = llm.engine.executor
    try:
        tokens, lps = _run(llm)
        assert llm.engine.scheduler.num_prefix_cached_tokens > 0
        info = executor.collective_rpc("describe")  # by name: a callable would have to be importable by the actor
        assert [i["rank"] for i in info] == [0, 1] and [i["embed_rows"] for i in info] == [160, 160]
        assert info[0]["pid"] == os.getpid() and info[1]["pid"] != os.getpid()
        actor_pid = info[1]["pid"]
        from ray.util import placement_group_table

        assert [t["state"] for t in placement_group_table().values()] == ["CREATED"]
        assert ray.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"  # a local instance on loopback only
    finally:
        executor.shutdown()
    assert tokens == ref_tokens
    for a, b in zip(lps, ref_lps):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert not ray.is_initialized()  # the executor started it, so it shut it down
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the actor's process is gone
        try:
            os.kill(actor_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the Ray actor of rank 1 (pid {actor_pid}) outlived the engine's shutdown")


def test_without_ray_asking_for_it_says_how_to_install(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is missing
    need = r"distributed_executor_backend: 'ray' needs Ray.*pip install 'turnout\[ray\]'"
    with pytest.raises(ValueError, match=need):
        LLM(tiny, tensor_parallel_size=2, distributed_executor_backend="ray", **KW)


@pytest.mark.gpu
def test_ray_tp2_on_two_gpus_matches_mp(tiny, monkeypatch):
    """NCCL: rank 0 in this process on the GPU the placeholder actor holds, rank 1 an actor on the other;
    the same tokens as the mp executor on the same two GPUs."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'turnout[ray]')")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    gpu = {**KW, "device": "cuda"}
    mp_llm = LLM(tiny, tensor_parallel_size=2, **gpu)
    try:
        ref_tokens, _ = _run(mp_llm)
    finally:
        mp_llm.engine.executor.shutdown()
    llm = LLM(tiny, tensor_parallel_size=2, distributed_executor_backend="ray", **gpu)
    try:
        tokens, _ = _run(llm)
        info = llm.engine.executor.collective_rpc("describe")
    finally:
        llm.engine.executor.shutdown()
    assert tokens == ref_tokens
    assert [i["device"] for i in info][1] == "cuda:0"  # the actor sees only the GPU Ray gave it
    assert not ray.is_initialized()
