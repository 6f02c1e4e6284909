"""HTTP hygiene of `turnout serve`: header / body / write deadlines, a connection limit, JSON-only POSTs,
duplicate Authorization headers, the per-request token budget. A real server with short limits, raw sockets
as the misbehaving clients."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from conftest import ServerProcess, free_port

MAX_CONN = 6


@pytest.fixture(scope="module")
def srv():
    s = ServerProcess("--max-model-len", "256", "--max-num-seqs", "2", "--timeout-header", "1",
                      "--timeout-body", "1", "--max-connections", str(MAX_CONN), "--h11-max-header-count", "40",
                      "--max-tokens-per-request", "200")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def _addr(srv):
    return ("127.0.0.1", srv.port)


def _read_all(sock, timeout) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or ``timeout``), and when it closed."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except TimeoutError:
        return out + b"<still open>", time.monotonic() - t0
    except ConnectionResetError:
        pass
    return out, time.monotonic() - t0


def _ok(srv):
    r = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"],
                         ids=["silent", "slow-headers"])
def test_headers_must_arrive_in_time(srv, sent):
    with socket.create_connection(_addr(srv)) as s:
        s.sendall(sent)
        out, took = _read_all(s, 5)
    assert out.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in out, out
    assert 0.8 < took < 3, took
    _ok(srv)


def test_body_must_arrive_in_time(srv):
    with socket.create_connection(_addr(srv)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        out, took = _read_all(s, 5)
    assert out.startswith(b"HTTP/1.1 408 ") and b"body" in out, out
    assert 0.8 < took < 3, took
    _ok(srv)


def test_a_prompt_client_is_not_cut_off(srv):
    """The deadlines bound the request, not the generation: a reply longer than them is fine."""
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for _ in range(2):  # keep-alive: the second request's header deadline starts after the first reply
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 24, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24


def test_connection_limit(srv):
    socks = [socket.create_connection(_addr(srv)) for _ in range(MAX_CONN + 3)]
    try:
        time.sleep(0.2)
        refused = 0
        for s in socks[MAX_CONN:]:
            out, _ = _read_all(s, 0.5)
            refused += out.startswith(b"HTTP/1.1 503 ") and b'"too_many_connections"' in out
        assert refused == 3
    finally:
        for s in socks:
            s.close()
    time.sleep(0.2)
    _ok(srv)


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "application/jsonp"])
def test_post_needs_a_json_content_type(srv, ctype):
    headers = {} if ctype is None else {"content-type": ctype}
    r = httpx.post(f"{srv.base_url}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 1}',
                   headers=headers, timeout=10)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["param"] == "Content-Type" and err["code"] == "unsupported_media_type"


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_content_types_are_accepted(srv, ctype):
    r = httpx.post(f"{srv.base_url}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 1}',
                   headers={"content-type": ctype}, timeout=30)
    assert r.status_code == 200, r.text


def test_two_authorization_headers_are_400(srv):
    r = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers=[("authorization", "Bearer a"), ("authorization", "Bearer b")], timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "Authorization"


def test_too_many_header_fields_are_431(srv):
    headers = [(f"x-h{i}", "v") for i in range(60)]
    r = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=headers,
                   timeout=10)
    assert r.status_code == 431 and r.json()["error"]["code"] == "too_many_headers"
    _ok(srv)


def test_max_tokens_per_request(srv):
    """--max-tokens-per-request 200: n x (prompt + max_tokens) over it is a 400 naming the limit."""
    url = f"{srv.base_url}/v1/completions"
    r = httpx.post(url, json={"prompt": "Hi", "n": 4, "max_tokens": 60}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens_per_request" and "200" in err["message"]
    r = httpx.post(url, json={"prompt": "Hi", "n": 2, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ a client that stops reading the response
def test_unread_response_is_abandoned_after_the_write_timeout():
    """In-process uvicorn with the guarded protocol and an app that streams as fast as it can; the client
    never reads. The server must drop the connection once its send buffer stayed full for write_timeout,
    and the app must see the disconnect (the server aborts the request there)."""
    import uvicorn

    from turnout.entrypoints.openai.http_guard import guarded_h11_protocol

    finished = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        chunk = b"x" * 65536
        try:
            for _ in range(20000):  # 1.3 GB: far more than any socket buffer
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            finished.set()

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            http=guarded_h11_protocol(5, 5, 1.0, None))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        t0 = time.monotonic()
        assert finished.wait(10), "the server kept a connection whose client reads nothing"
        took = time.monotonic() - t0
        assert 0.9 < took < 6, took
        s.close()
    finally:
        server.should_exit = True
        thread.join(10)

