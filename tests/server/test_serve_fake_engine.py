"""Edge cases of the server and AsyncLLMEngine, in-process around a fake engine (no model load)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from conftest import InProcessServer  # at collection, while tests/server's conftest is the one imported
from serve_fakes import FakeEngine
from turnout.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineDraining, QueueFull
from turnout.engine.sampling_params import SamplingParams

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def gauges(base_url):
    text = httpx.get(f"{base_url}/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("turnout_") and "{" not in line:
            name, value = line.split(" ")
            out[name] = float(value)
    return out


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# ---------------------------------------------------------------------------------------------- api key
def test_api_key_required_on_v1_only(fake_server):
    with fake_server(api_key="s3cret") as srv:
        u = srv.base_url
        assert httpx.get(f"{u}/health").status_code == 200
        assert httpx.get(f"{u}/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            r = httpx.post(f"{u}/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{u}/v1/models").status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{u}/v1/models", headers=ok).status_code == 200
        r = httpx.post(f"{u}/v1/chat/completions", json=CHAT, headers=ok)
        assert r.status_code == 200, r.text


def test_api_key_with_openai_client(fake_server):
    import openai

    with fake_server(api_key="k") as srv:
        bad = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="k", max_retries=0)
        assert good.models.list().data[0].id == "fake-model"


# ---------------------------------------------------------------------------------------------- limits
def test_body_size_limit(fake_server):
    with fake_server(max_request_bytes=2048) as srv:
        r = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: the limit must hold while streaming the body in
            for _ in range(10):
                yield b"x" * 1000

        r = httpx.post(f"{srv.base_url}/v1/completions", content=chunked(),
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_loading_returns_503(fake_server):
    import threading

    from turnout.entrypoints.openai.api_server import ServerState

    gate = threading.Event()

    def slow_factory():
        gate.wait(10)
        return FakeEngine()

    with InProcessServer(ServerState(engine_factory=slow_factory)) as srv:
        assert httpx.get(f"{srv.base_url}/health").status_code == 503
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        gate.set()
        assert wait_for(lambda: httpx.get(f"{srv.base_url}/health").status_code == 200)
        assert httpx.post(f"{srv.base_url}/v1/chat/completions", json=CHAT).status_code == 200


# ---------------------------------------------------------------------------------------------- engine death
def test_engine_failure_fails_requests_and_health(fake_server):
    eng = FakeEngine(step_delay=0.02, fail_after_steps=3)
    with fake_server(engine=eng) as srv:
        u = srv.base_url
        body = {"prompt": "hello", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", f"{u}/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_dead" and "simulated device failure" in err["message"]
        assert httpx.get(f"{u}/health").status_code == 503
        r = httpx.post(f"{u}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert gauges(u)["turnout_engine_healthy"] == 0


def test_engine_failure_non_streaming_gets_500(fake_server):
    eng = FakeEngine(step_delay=0.02, fail_after_steps=2)
    with fake_server(engine=eng) as srv:
        r = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 50}, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"


# ---------------------------------------------------------------------------------------------- disconnects
def test_disconnect_aborts_within_a_step(fake_server):
    eng = FakeEngine(step_delay=0.02, max_model_len=4096)
    with fake_server(engine=eng) as srv:
        u = srv.base_url
        with httpx.stream("POST", f"{u}/v1/completions", json={"prompt": "x", "max_tokens": 1000,
                                                                "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        assert wait_for(lambda: len(eng.aborted) == 1, 2.0)
        assert wait_for(lambda: gauges(u)["turnout_num_requests_running"] == 0)
        # non-streaming: a client timeout closes the connection
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{u}/v1/completions", json={"prompt": "x", "max_tokens": 1000}, timeout=0.2)
        assert wait_for(lambda: len(eng.aborted) == 2, 2.0)
        g = gauges(u)
        assert g["turnout_num_requests_in_flight"] == 0 and g["turnout_kv_cache_usage_perc"] == 0


# ---------------------------------------------------------------------------------------------- queue bound
def test_queue_full_is_all_or_nothing(fake_server):
    eng = FakeEngine(step_delay=0.05, max_num_seqs=1)
    with fake_server(engine=eng, max_queue=1) as srv:
        u = srv.base_url

        async def go():
            async with httpx.AsyncClient(base_url=u, timeout=30) as c:
                first = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 30}))
                await asyncio.sleep(0.3)  # first is running; one slot in the queue is left
                # two prompts need two slots: refused whole, nothing half-admitted
                r = await c.post("/v1/completions", json={"prompt": ["b", "c"], "max_tokens": 2})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
                assert eng.stats.prompt_tokens_total == 1  # only "a" ever reached the engine
                second = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "d", "max_tokens": 2}))
                await asyncio.sleep(0.2)
                r = await c.post("/v1/completions", json={"prompt": "e", "max_tokens": 2})
                assert r.status_code == 503
                assert (await first).status_code == 200 and (await second).status_code == 200
                r = await c.post("/v1/completions", json={"prompt": "f", "max_tokens": 2})
                assert r.status_code == 200

        asyncio.run(go())


# ---------------------------------------------------------------------------------------------- AsyncLLMEngine
def test_async_engine_generate_abort_and_drain():
    async def go():
        eng = FakeEngine(step_delay=0.01)
        ae = AsyncLLMEngine(eng, max_queue=2, max_num_seqs=4).start()
        outs = [o async for o in ae.generate("r1", "hi", SamplingParams(max_tokens=5, seed=1))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        # leaving the iterator early aborts
        agen = ae.generate("r2", "hi", SamplingParams(max_tokens=500))
        await agen.__anext__()
        await agen.aclose()
        await asyncio.sleep(0.1)
        assert "r2" in eng.aborted and not eng.has_unfinished_requests()
        # bad prompt: ValueError, nothing left behind
        with pytest.raises(ValueError, match="prompt"):
            await ae.add_request("r3", "", SamplingParams())
        assert ae.num_in_flight == 0
        # drain: the running request finishes, new ones are refused, a too-slow one is aborted at the timeout
        s = await ae.add_request("r4", "hi", SamplingParams(max_tokens=10))
        slow = await ae.add_request("r5", "hi", SamplingParams(max_tokens=100))
        task = asyncio.ensure_future(ae.shutdown(drain_timeout=0.5))
        await asyncio.sleep(0.05)
        with pytest.raises(EngineDraining):
            await ae.add_request("r6", "hi", SamplingParams())
        assert [o async for o in s][-1].finished
        with pytest.raises(EngineDraining):
            async for _ in slow:
                pass
        await task
        assert not ae.is_running

    asyncio.run(go())


def test_async_engine_queue_full_and_death():
    async def go():
        eng = FakeEngine(step_delay=0.05, max_num_seqs=1, fail_after_steps=20)
        ae = AsyncLLMEngine(eng, max_queue=1, max_num_seqs=1).start()
        a = await ae.add_request("a", "x", SamplingParams(max_tokens=100))
        await asyncio.sleep(0.2)
        b = await ae.add_request("b", "x", SamplingParams(max_tokens=100))
        with pytest.raises(QueueFull):
            await ae.add_request("c", "x", SamplingParams())
        for s in (a, b):
            with pytest.raises(EngineDeadError, match="simulated"):
                async for _ in s:
                    pass
        with pytest.raises(EngineDeadError):
            await ae.add_request("d", "x", SamplingParams())

    asyncio.run(go())


def test_a_fault_traced_to_one_request_fails_it_alone(fake_server):
    """RequestOutput.error (the engine isolated a fault to this request): that client gets a 500 naming it,
    in-band when streaming; a request running beside it finishes; the server stays healthy."""
    import threading

    eng = FakeEngine(step_delay=0.02)
    with fake_server(engine=eng) as srv:
        url = f"{srv.base_url}/v1/completions"
        other = {}
        t = threading.Thread(target=lambda: other.update(r=httpx.post(url, json={"prompt": "ok", "max_tokens": 12},
                                                                       timeout=30)))
        t.start()
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 10, "stop": ["FAIL-REQUEST"]}, timeout=30)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "request_failed" and "injected fault" in err["message"]
        with httpx.stream("POST", url, json={"prompt": "x", "max_tokens": 10, "stream": True,
                                             "stop": ["FAIL-REQUEST"]}, timeout=30) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"request_failed"' in events[-2]
        t.join(30)
        assert other["r"].status_code == 200 and other["r"].json()["usage"]["completion_tokens"] == 12
        assert httpx.get(f"{srv.base_url}/health").status_code == 200


def test_a_certain_token_keeps_its_logprob_of_zero():
    """logprob 0.0 (a forced token, e.g. under a grammar) is a value, not a missing one (-9999)."""
    from turnout.engine.outputs import Logprob
    from turnout.entrypoints.openai.serving_logprobs import chat_logprobs

    class _State:
        def decode_token(self, tid):
            return chr(tid)

    out = chat_logprobs(_State(), [97], [{97: Logprob(0.0, 1, "a")}], 0, 1)
    assert out.content[0].logprob == 0.0 and out.content[0].top_logprobs[0].logprob == 0.0
