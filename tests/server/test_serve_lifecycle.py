"""Its own `turnout serve` instance: --api-key, a queue bound of 1 behind 1 running slot, SIGTERM drain."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from conftest import ServerProcess

openai = pytest.importorskip("openai")

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def srv():
    s = ServerProcess("--max-model-len", "512", "--max-num-seqs", "1", "--max-queue", "1", "--api-key", KEY,
                      "--served-model-name", "smol", "--drain-timeout", "60")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def gauges(srv) -> dict:
    text = httpx.get(f"{srv.base_url}/metrics").text
    return {k: float(v) for k, v in re.findall(r"^(turnout_[a-z_]+) ([0-9.eE+-]+)$", text, re.M)}


def wait_gauges(srv, timeout=10.0, **want):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = gauges(srv)
        if all(g[f"turnout_{k}"] == v for k, v in want.items()):
            return g
        time.sleep(0.05)
    raise AssertionError(f"gauges never reached {want}: {gauges(srv)}")


class Streamer(threading.Thread):
    """Reads one streaming completion in the background; `stop` hangs up."""

    def __init__(self, srv, body):
        super().__init__(daemon=True)
        self.srv, self.body = srv, body
        self.status, self.events, self.first = None, [], threading.Event()
        self.hang_up = threading.Event()

    def run(self):
        with httpx.stream("POST", f"{self.srv.base_url}/v1/completions", json=self.body, headers=AUTH,
                          timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    if len(self.events) >= 1:
                        self.first.set()
                if self.hang_up.is_set():
                    break
        self.first.set()


def test_api_key(srv):
    u = srv.base_url
    assert httpx.get(f"{u}/health").status_code == 200
    r = httpx.get(f"{u}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{u}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"}
                      ).status_code == 401
    c = openai.OpenAI(base_url=f"{u}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in c.models.list().data] == ["smol"]
    r = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens <= 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{u}/v1", api_key="wrong", max_retries=0).models.list()


def test_queue_bound_503_with_retry_after(srv):
    a = Streamer(srv, {"prompt": "a", **LONG})
    a.start()
    assert a.first.wait(60)
    wait_gauges(srv, num_requests_running=1)
    b = Streamer(srv, {"prompt": "b", **LONG})
    b.start()
    wait_gauges(srv, num_requests_waiting=1)
    r = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "c", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
    g = gauges(srv)  # nothing half-admitted: still exactly a (running) and b (waiting)
    assert g["turnout_num_requests_in_flight"] == 2 and g["turnout_num_requests_waiting"] == 1
    a.hang_up.set()
    b.hang_up.set()
    a.join(30)
    b.join(30)
    wait_gauges(srv, num_requests_running=0, num_requests_waiting=0, num_requests_in_flight=0,
                kv_cache_usage_perc=0)
    assert httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "c", "max_tokens": 2},
                      headers=AUTH).status_code == 200


def test_sigterm_drains_then_exits_0(srv):
    n = 12
    a = Streamer(srv, {"prompt": "Count:", **LONG, "max_tokens": n, "logprobs": 0})
    a.start()
    assert a.first.wait(60)
    srv.proc.send_signal(signal.SIGTERM)
    # new requests are refused while the running one finishes
    deadline = time.monotonic() + 10
    while True:
        r = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
        if r.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    assert httpx.get(f"{srv.base_url}/health").status_code == 503
    a.join(120)
    assert a.status == 200 and a.events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in a.events[:-1]]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]) == n
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert srv.proc.wait(30) == 0
