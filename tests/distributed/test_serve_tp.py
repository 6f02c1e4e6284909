"""`turnout serve -tp 2` end to end (a tiny Qwen3 split over 2 gloo ranks on the CPU) driven by the official
openai client: chat, streaming, n=2, abort on client disconnect; greedy output equal to the TP=1 engine's;
then SIGTERM drains, exits 0 and leaves no worker process (checked by PID)."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from serve_helpers import Serve, gone, save_tiny

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_tp"))


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    srv = Serve(tiny, "-tp", "2", "--seed", "0", log_dir=tmp_path_factory.mktemp("log")).wait_healthy()
    yield srv
    srv.kill()


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_streaming_and_n2_match_one_rank(server, tiny):
    from turnout import LLM, SamplingParams

    c = _client(server)
    model = c.models.list().data[0].id
    msgs = [{"role": "user", "content": "t5 t6 t7"}]
    chat = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=model, messages=msgs, max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert chat.choices[0].message.content == streamed and chat.usage.completion_tokens == 8
    two = c.completions.create(model=model, prompt=[3, 4, 5], max_tokens=6, n=2, temperature=1.0, seed=11)
    assert sorted(ch.index for ch in two.choices) == [0, 1]

    llm = LLM(tiny, device="cpu", dtype="float32", kv_cache_memory=8 << 20)  # TP=1, the same weights
    tok = llm.get_tokenizer()
    ids = llm.engine.apply_chat_template(msgs)
    ref = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
    assert tok.decode(ref.token_ids) == tok.decode(tok.encode(chat.choices[0].message.content))


def _aborts(srv) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=5).text
    m = re.search(r'^turnout_request_finished_total\{finished_reason="abort"\} ([0-9.]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_client_disconnect_aborts_the_request(server):
    before = _aborts(server)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": [3, 4], "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    deadline = time.monotonic() + 20
    while _aborts(server) <= before:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)
    running = re.search(r"^turnout_num_requests_running ([0-9.]+)$", httpx.get(server.url + "/metrics").text, re.M)
    assert float(running.group(1)) == 0


def test_sigterm_drains_exits_0_and_leaves_no_worker(server):
    pids = [p.pid for p in server.descendants()]
    assert pids, "no worker process under the server"
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": [3, 4], "max_tokens": 24, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        server.proc.send_signal(signal.SIGTERM)  # mid-stream: the request still finishes
        rest = "".join(lines)
    assert '"finish_reason":"length"' in rest and rest.endswith("data: [DONE]")
    assert server.proc.wait(60) == 0, server.log()
    assert gone(pids) == [], server.log()
