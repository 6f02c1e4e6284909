"""HTTP hygiene, below the routes: what a client may hold and how long, before any request reaches the engine.

Two layers, each where its information is:

* ``guarded_h11_protocol(...)``: uvicorn's h11 protocol with deadlines uvicorn lacks. A connection must
  deliver its request headers within ``header_timeout`` seconds (from connecting, or from the end of the
  previous response) and then its body within ``body_timeout``; a response the client stops reading is
  abandoned after ``write_timeout`` seconds in which the client acknowledged none of the bytes waiting for
  it (on Linux, counted from the kernel's send queue, so a stream is cut once the client's own receive
  buffer is full, not after the megabytes the kernel would buffer for it; elsewhere: after that long with
  the send buffer full); connections beyond ``max_connections``
  are refused at once. A stalled or refused connection gets an OpenAI-shaped 408 / 503 where no response
  has started on it, then it is closed; an aborted connection is a disconnect to the app (its request is
  aborted within a step). A request h11 cannot parse gets a JSON 400 too, not uvicorn's plain text.
* ``RequestGuard`` (pure ASGI): duplicate ``Authorization`` headers (400), the API key on /v1/* and
  ``KEYED_PATHS`` (401), too many header fields (431), a POST whose Content-Type is not JSON (415: a
  browser's cross-origin "simple" POST, text/plain or a form, must not start a generation), the body size
  limit (413, chunked uploads too).
"""

from __future__ import annotations

import hmac
import json
import logging
import struct

from turnout.entrypoints.openai.errors import error_response
from turnout.entrypoints.openai.rl_routes import RL_PATHS  # the RL endpoints need the key too

logger = logging.getLogger("turnout.serve")

_DRAIN_FACTOR = 16  # bodies up to 16x the limit are read away before the 413; larger ones are cut off
_JSON = b"application/json"
# Data endpoints outside /v1 that need the API key too: web.py's op table, the tokenizer (a chat template
# and a tool list cost seconds to render: no keyless caller may spend them), the API description.
KEYED_PATHS = frozenset({"/ops", "/tokenize", "/detokenize", "/openapi.json"}) | RL_PATHS


def _error_body(message: str, type: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()


try:  # bytes in a socket's send queue its peer has not acknowledged: Linux (elsewhere the ioctl fails: None)
    import fcntl
    import termios

    _TIOCOUTQ = getattr(termios, "TIOCOUTQ", None)
except ImportError:  # not a Unix
    _TIOCOUTQ = None


def _unacknowledged(sock) -> int | None:
    """Bytes written to ``sock`` that its peer has not acknowledged yet, or None where unknown."""
    if _TIOCOUTQ is None or sock is None:
        return None
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return None


class _CountingTransport:
    """The connection's transport with a running count of the bytes written through it."""

    def __init__(self, inner, on_write):
        self._inner, self._on_write = inner, on_write

    def write(self, data) -> None:
        self._inner.write(data)
        self._on_write(len(data))

    def __getattr__(self, name):
        return getattr(self._inner, name)


def guarded_h11_protocol(header_timeout: float, body_timeout: float, write_timeout: float,
                         max_connections: int | None):
    """An ``asyncio.Protocol`` class for ``uvicorn.Config(http=...)``: H11Protocol plus the deadlines above."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _read_timer = None  # header or body deadline, whichever phase the request is in
        _read_phase = None  # "header" | "body" | None
        _write_timer = None
        _sock = None  # the socket, where its send queue can be read (reader progress)
        _written = _acked = 0  # bytes written, bytes the client has acknowledged
        _acked_at = 0.0
        _progress_timer = None

        # ---- connection
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if write_timeout and write_timeout > 0 and _unacknowledged(sock) is not None:
                self._sock = sock
                self.transport = _CountingTransport(transport, self._on_write)  # the request cycles write here
            if max_connections is not None and len(self.connections) > max_connections:
                logger.warning("connection limit (%d) reached: refusing %s", max_connections, self.client)
                self._respond_and_close(503, "Service Unavailable",
                                        f"The server holds its limit of {max_connections} connections; retry later.",
                                        "service_unavailable", "too_many_connections", retry_after=True)
                return
            self._arm_read("header")

        def connection_lost(self, exc) -> None:
            self._cancel_read()
            self._cancel_write()
            if self._progress_timer is not None:
                self._progress_timer.cancel()
                self._progress_timer = None
            super().connection_lost(exc)

        # ---- reading the request
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track_read()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start the next cycle and parse a pipelined request
            if not self.transport.is_closing():
                if self.conn.their_state is h11.IDLE:
                    self._arm_read("header")
                else:
                    self._track_read()

        def _track_read(self) -> None:
            state = self.conn.their_state
            if state is h11.IDLE:
                if self._read_phase is None:
                    self._arm_read("header")
            elif state is h11.SEND_BODY:
                if self._read_phase != "body":
                    self._arm_read("body")
            else:  # DONE, MUST_CLOSE, CLOSED, ERROR: nothing more to wait for
                self._cancel_read()

        def _arm_read(self, phase: str) -> None:
            self._cancel_read()
            timeout = header_timeout if phase == "header" else body_timeout
            if timeout and timeout > 0:
                self._read_phase = phase
                self._read_timer = self.loop.call_later(timeout, self._read_timed_out, phase, timeout)

        def _cancel_read(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._read_timer = self._read_phase = None

        def _read_timed_out(self, phase: str, timeout: float) -> None:
            self._read_timer = self._read_phase = None
            if self.transport.is_closing():
                return
            what = "headers" if phase == "header" else "body"
            self._respond_and_close(408, "Request Timeout", f"The request {what} did not arrive within "
                                    f"{timeout:g} seconds.", "invalid_request_error", "request_timeout")

        # ---- writing the response
        def pause_writing(self) -> None:
            super().pause_writing()
            if write_timeout and write_timeout > 0 and self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._write_timed_out)

        def resume_writing(self) -> None:
            self._cancel_write()
            super().resume_writing()

        def _cancel_write(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_timed_out(self) -> None:
            self._write_timer = None
            logger.info("client %s read nothing for %gs: closing its connection", self.client, write_timeout)
            self.transport.abort()  # connection_lost: the app sees a disconnect and aborts the request

        def send_400_response(self, msg: str) -> None:
            # uvicorn's own answer to a request h11 cannot parse (a bad request line, a malformed header, a
            # header block over --h11-max-incomplete-event-size) is text/plain; OpenAI clients parse JSON
            self._respond_and_close(400, "Bad Request", f"{msg} The request line or headers are not valid "
                                    "HTTP/1.1 (or exceed --h11-max-incomplete-event-size).",
                                    "invalid_request_error", "invalid_http_request")

        # ---- is the client reading what we write? (where the send queue can be read)
        def _on_write(self, n: int) -> None:
            self._written += n
            if self._progress_timer is None:  # nothing was waiting for the client: its clock starts now
                self._acked_at = self.loop.time()
                self._progress_timer = self.loop.call_later(self._check_period(), self._check_progress)

        def _check_period(self) -> float:
            return min(1.0, write_timeout / 4)

        def _check_progress(self) -> None:
            self._progress_timer = None
            if self.transport.is_closing():
                return
            queued = _unacknowledged(self._sock)
            if queued is None:
                return
            waiting = queued + self.transport.get_write_buffer_size()
            acked, now = self._written - waiting, self.loop.time()
            if acked != self._acked:
                self._acked, self._acked_at = acked, now
            if waiting <= 0:
                return  # all delivered; the next write starts the clock again
            if now - self._acked_at >= write_timeout:
                self._write_timed_out()
                return
            self._progress_timer = self.loop.call_later(self._check_period(), self._check_progress)

        def _respond_and_close(self, status: int, reason: str, message: str, type: str, code: str,
                               retry_after: bool = False) -> None:
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no response started yet: say why
                body = _error_body(message, type, code)
                head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(body)}\r\nconnection: close\r\n"
                        + ("retry-after: 1\r\n" if retry_after else "") + "\r\n")
                self.transport.write(head.encode("ascii") + body)
            self.transport.close()

    return GuardedH11Protocol


class RequestGuard:
    """Pure ASGI middleware (see the module docstring). Buffers the body so that the size limit holds for
    chunked uploads too, then replays it; later receives (disconnects) pass through."""

    def __init__(self, app, state, max_header_count: int = 100):
        self.app, self.state, self.max_header_count = app, state, max_header_count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        headers = scope["headers"]
        if len(headers) > self.max_header_count:
            return await error_response(431, f"The request has {len(headers)} header fields; at most "
                                        f"{self.max_header_count} are allowed.", code="too_many_headers",
                                        headers={"Connection": "close"})(scope, receive, send)
        auths = [v for k, v in headers if k == b"authorization"]
        if len(auths) > 1:
            return await error_response(400, "Authorization: the header is given more than once.",
                                        param="Authorization", code="duplicate_header")(scope, receive, send)
        if state.api_key and (scope["path"].startswith("/v1") or scope["path"] in KEYED_PATHS):
            scheme, _, token = (auths[0] if auths else b"").partition(b" ")
            expected = state.api_key.encode()
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected)):
                return await error_response(401, "Invalid or missing API key (Authorization: Bearer <key>).",
                                            code="invalid_api_key",
                                            headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        ctype = next((v for k, v in headers if k == b"content-type"), None)
        media = (ctype or b"").split(b";", 1)[0].strip().lower()
        if not (media == _JSON or (media.startswith(b"application/") and media.endswith(b"+json"))):
            shown = ctype.decode("latin-1")[:80] if ctype is not None else "missing"
            return await error_response(415, f"Content-Type: must be application/json, got {shown}.",
                                        param="Content-Type", code="unsupported_media_type")(scope, receive, send)
        limit = state.max_request_bytes
        too_big = error_response(413, f"The request body exceeds {limit} bytes.", code="request_too_large",
                                 headers={"Connection": "close"})
        declared = next((v for k, v in headers if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            if declared.isdigit() and int(declared) <= _DRAIN_FACTOR * limit:
                # read the body away first (the body deadline still bounds a slow sender): a client still
                # sending when the server closes sees a reset, not the 413 that names the limit
                while (msg := await receive())["type"] != "http.disconnect" and msg.get("more_body", False):
                    pass
            return await too_big(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await too_big(scope, receive, send)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
