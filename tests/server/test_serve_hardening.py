"""What a hostile or careless client must not get from `turnout serve`: /tokenize and /detokenize without the
key, the API description without --enable-docs (or without the key), a CDN-loading docs page, a server that
starts open because --api-key was empty, RL endpoints with no key and no warning, plain-text protocol
errors; /tokenize floods that delay generation; a /health that says 200 while the engine is stuck."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import REPO, ServerProcess

openai = pytest.importorskip("openai")

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed():
    s = ServerProcess("--max-model-len", "256", "--max-num-seqs", "2", "--api-key", KEY, "--enable-docs",
                      "--timeout-write", "1")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def test_tokenize_and_detokenize_need_the_key(keyed):
    u = keyed.base_url
    for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(u + path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(u + path, json=body, headers=AUTH).status_code == 200, path
    # the openai client's own request path, keyed as for /v1
    c = openai.OpenAI(base_url=u, api_key=KEY, max_retries=0)
    assert c.post("/tokenize", body={"prompt": "hello"}, cast_to=object)["count"] >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=u, api_key="nope", max_retries=0).post("/tokenize", body={"prompt": "x"},
                                                                      cast_to=object)


def test_docs_with_enable_docs_only_openapi_behind_the_key(keyed):
    u = keyed.base_url
    assert httpx.get(u + "/openapi.json").status_code == 401
    r = httpx.get(u + "/openapi.json", headers=AUTH)
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]
    for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):  # FastAPI's pages load swagger / redoc from a CDN
        r = httpx.get(u + page, headers=AUTH)
        assert r.status_code == 404 and "cdn" not in r.text.lower(), page


def _finished(srv) -> dict[str, float]:
    text = httpx.get(srv.base_url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^turnout_request_finished_total\{finished_reason="(\w+)"\} ([0-9.e+]+)$', text, re.M)}


def test_a_stream_nobody_reads_is_aborted(keyed):
    """Before: the whole generation ran into the kernel's send buffers, holding its KV to the end."""
    before = _finished(keyed)
    body = json.dumps({"prompt": "Count:", "max_tokens": 240, "ignore_eos": True, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader's small window, never emptied
    s.connect(("127.0.0.1", int(keyed.base_url.rsplit(":", 1)[1])))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            after = _finished(keyed)
            if sum(after.values()) > sum(before.values()):
                break
            time.sleep(0.2)
    finally:
        s.close()
    assert after.get("abort", 0) == before.get("abort", 0) + 1, (before, after)
    assert after.get("length", 0) == before.get("length", 0), "the unread stream ran to its end"


def test_docs_off_by_default(server):
    for page in ("/docs", "/redoc", "/openapi.json"):
        r = httpx.get(server.base_url + page)
        assert r.status_code == 404, page
        assert r.json()["error"]["code"] == "not_found"


def test_h11_protocol_errors_are_json(server):
    with socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n")
        raw = b""
        while chunk := s.recv(4096):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), raw
    assert b"application/json" in head.lower()
    assert json.loads(body)["error"]["code"] == "invalid_http_request"


def _serve_cli(*args: str, wait_for: str | None = None, timeout: float = 60) -> tuple[int | None, str]:
    """Run `turnout serve ARGS`; returns (exit status or None if still running, output so far). With
    ``wait_for``, stops the server as soon as that text appears in its output."""
    proc = subprocess.Popen([sys.executable, "-m", "turnout.entrypoints.cli", "serve", "--port", "0", *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if wait_for and wait_for in "".join(out):
            break
        time.sleep(0.1)
    code = proc.poll()
    if code is None:
        proc.kill()
        proc.wait()
    reader.join(5)
    return code, "".join(out)


def test_empty_api_key_is_a_startup_error():
    code, out = _serve_cli("--api-key", "")
    assert code == 2, out
    assert "--api-key" in out and "empty" in out, out


def test_rl_endpoints_without_key_warn_loudly():
    _, out = _serve_cli("--enable-rl-endpoints", wait_for="--enable-rl-endpoints without --api-key")
    assert "WARNING" in out and "--enable-rl-endpoints without --api-key" in out, out


# ---------------------------------------------------------------------------------------------- fake engine
class SlowTokenizer:
    """The fake engine's byte tokenizer, but encoding a text that holds SLOW takes a second."""

    def __init__(self, inner):
        self.inner = inner

    def encode(self, text, add_special_tokens=True):
        if "SLOW" in text:
            time.sleep(1.0)
        return self.inner.encode(text, add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self):
        return len(self.inner)


def test_tokenize_flood_neither_delays_generation_nor_queues_without_bound(fake_server):
    from serve_fakes import FakeEngine

    engine = FakeEngine()
    engine.tokenizer = SlowTokenizer(engine.tokenizer)
    with fake_server(engine=engine, api_key="k") as srv:
        h = {"Authorization": "Bearer k"}
        results = []

        def flood():
            results.append(httpx.post(srv.base_url + "/tokenize", json={"prompt": "SLOW" * 1000}, headers=h,
                                      timeout=60).status_code)

        threads = [threading.Thread(target=flood) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        r = httpx.post(srv.base_url + "/v1/completions", headers=h, timeout=30,
                       json={"model": "fake-model", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 1.0  # not behind eight seconds of tokenizing
        assert httpx.get(srv.base_url + "/health", timeout=1).status_code == 200
        for t in threads:
            t.join(60)
        assert sorted(results) == [200] * 4 + [429] * 4, results


def test_health_reports_a_stalled_engine(fake_server):
    from serve_fakes import FakeEngine

    engine = FakeEngine(step_delay=2.5)  # one step outlasts stall_after_s
    with fake_server(engine=engine, stall_after_s=1.0) as srv:
        u = srv.base_url
        t = threading.Thread(target=lambda: httpx.post(u + "/v1/completions", timeout=60,
                                                       json={"model": "fake-model", "prompt": "x", "max_tokens": 2}))
        t.start()
        deadline = time.monotonic() + 10
        seen = None
        while time.monotonic() < deadline:
            r = httpx.get(u + "/health", timeout=1)
            if r.status_code == 503:
                seen = r.json()
                break
            time.sleep(0.1)
        assert seen is not None and seen["status"] == "stalled" and "1 request" in seen["reason"], seen
        age = re.search(r"^turnout_engine_loop_age_seconds ([0-9.]+)$", httpx.get(u + "/metrics").text, re.M)
        assert age, "no turnout_engine_loop_age_seconds gauge"
        t.join(60)
        assert httpx.get(u + "/health").status_code == 200  # idle again: nothing waits on it
