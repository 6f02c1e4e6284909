"""Faults of a tensor-parallel engine (gloo, CPU, tiny models): a rank that hangs in a collective is named and
killed by the step watchdog within distributed_timeout_s; a `turnout serve -tp 2` whose worker is killed
mid-generation fails every client cleanly, answers 503 and exits 1 leaving no process behind; ranks given
different configurations refuse to start, naming the field."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import torch.multiprocessing as tmp

from serve_helpers import Serve, gone, save_tiny
from turnout import SamplingParams
from turnout.config import EngineConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_faults"))


def test_a_hung_rank_is_named_and_killed_by_the_step_watchdog(tiny):
    from turnout.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny, device="cpu", dtype="float32", kv_cache_memory=4 << 20,
                                    tensor_parallel_size=2, distributed_timeout_s=3.0))
    proc = engine.executor._procs[0]
    try:
        for i in range(4):
            engine.add_request(str(i), [3, 4, 5], SamplingParams(max_tokens=400, ignore_eos=True))
        engine.step()
        os.kill(proc.pid, signal.SIGSTOP)  # frozen mid-generation: its peer waits in the next all_reduce
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {proc.pid}\) hung: no heartbeat"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 20
        proc.join(5)
        assert proc.exitcode == -signal.SIGKILL  # the watchdog killed it: nothing is left waiting
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        engine.executor.shutdown()


def _stream(url, out):
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": [3, 4, 5], "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            out["status"] = r.status_code
            out["body"] = "".join(r.iter_text())
    except httpx.HTTPError as e:  # the server went away mid-stream: also not a hang
        out["error"] = repr(e)


def test_serve_tp2_worker_killed_mid_generation(tiny, tmp_path):
    srv = Serve(tiny, "-tp", "2", "--dead-engine-grace", "2", log_dir=tmp_path).wait_healthy()
    try:
        pids = [p.pid for p in srv.descendants()]
        outs = [{} for _ in range(3)]
        threads = [threading.Thread(target=_stream, args=(srv.url, o), daemon=True) for o in outs]
        for t in threads:
            t.start()
        time.sleep(1.5)  # the streams are generating
        # rank 1: the process that runs worker_main (spawned multiprocessing children; the resource tracker is not one)
        rank1 = next(p for p in srv.descendants() if "spawn_main" in " ".join(p.cmdline()))
        rank1.kill()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a client hung"
        for o in outs:  # each stream ended with an error event naming the rank, not a finished completion
            assert "error" in o or ("rank 1" in o["body"] and '"finish_reason":"length"' not in o["body"]), o
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and srv.proc.poll() is None:
            try:
                if httpx.get(srv.url + "/health", timeout=2).status_code == 503:
                    break
            except httpx.HTTPError:
                break
            time.sleep(0.1)
        assert srv.proc.wait(30) == 1, srv.log()
        assert gone(pids) == [], srv.log()
    finally:
        srv.kill()


def _rank(rank, path, seeds):
    """One rank of a 2-rank gloo world that checks its config against rank 0's."""
    from turnout.distributed import destroy_distributed, init_distributed
    from turnout.platforms import detect_platform
    from turnout.worker.lifecycle import check_same_config

    tp = init_distributed(detect_platform("cpu"), rank=rank, world_size=2, init_method=f"file://{path}")
    try:
        check_same_config(EngineConfig(seed=seeds[rank], nnodes=2, node_rank=rank, tensor_parallel_size=2), rank, tp.group)
        raise SystemExit(0)
    except ValueError as e:
        assert "seed=5 (rank 0: 0)" in str(e) and "node_rank" not in str(e), str(e)
        raise SystemExit(3) from None
    finally:
        destroy_distributed()


def test_ranks_with_different_configs_refuse_to_start(tmp_path):
    ctx = tmp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), (0, 5))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [3, 3]  # both refused, naming the field (node_rank may differ)


def test_a_tokenizer_object_compares_by_its_class():
    """Each rank builds its own tokenizer object (the benchmarks pass a NullTokenizer for dummy weights): the config
    check compares its class, not its repr, which names an address that differs in every process (TP=2 benchmark
    ranks refused to start over it)."""
    import torch

    from turnout.entrypoints.bench_models import NullTokenizer
    from turnout.worker.lifecycle import _comparable, config_fields, config_hash

    a, b = EngineConfig(tokenizer=NullTokenizer()), EngineConfig(tokenizer=NullTokenizer())
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(EngineConfig(tokenizer=object()))
    assert config_hash(EngineConfig(tokenizer="x")) != config_hash(EngineConfig(tokenizer="y"))
    assert config_fields(a)["tokenizer"].endswith("NullTokenizer>")
    assert _comparable(torch.float16) != _comparable(torch.bfloat16)  # an object with a plain repr keeps its value
