"""One streamed request of `turnout bench serve`, timed chunk by chunk; and the SSE reader that
benchmarks/serve_load.py shares.

A request never raises: an HTTP error status, an error event inside the stream, a dropped connection or a
timeout makes a failed :class:`RequestResult` carrying the reason, so a run always finishes and counts them.
Output tokens are the usage chunk's ``completion_tokens`` (``stream_options.include_usage``); the chunk
arrival times give TTFT (first chunk with content) and the inter-chunk latencies.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

DONE = "[DONE]"


async def sse_events(response):
    """The ``data:`` events of a streamed response: each parsed JSON object, or :data:`DONE` for the end
    marker (yielded, not swallowed, so a caller can check there is exactly one). Bad JSON raises
    ``json.JSONDecodeError``."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        yield DONE if data.strip() == DONE else json.loads(data)


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    start: float = 0.0  # time.perf_counter() when the request was sent
    ttft: float | None = None  # s
    e2el: float | None = None  # s
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of every chunk with content
    prompt_tokens: int | None = None  # from usage; None when the server sent none
    output_tokens: int = 0
    usage_reported: bool = False

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, as vLLM defines it: (e2el - ttft) / (tokens - 1)."""
        if not self.ok or self.output_tokens < 2 or self.ttft is None or self.e2el is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def request_body(endpoint: str, req, model: str, *, temperature: float, ignore_eos: bool, extra: dict) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if endpoint == "chat":
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    body.update(extra)
    return body


def _has_content(chunk: dict, endpoint: str) -> bool:
    for c in chunk.get("choices") or []:
        if endpoint == "chat":
            d = c.get("delta") or {}
            if d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
                return True
        elif c.get("text"):
            return True
    return False


async def send(client, path: str, endpoint: str, body: dict) -> RequestResult:
    """POST ``body`` to ``path``, stream the answer, time it. Never raises (see the module docstring)."""
    import httpx

    res = RequestResult(start=time.perf_counter())
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"HTTP {r.status_code}: {_error_text(r)}"
                return res
            done = False
            async for ev in sse_events(r):
                if ev == DONE:
                    done = True
                    break
                if "error" in ev:
                    res.error = f"error event: {ev['error']}"
                    return res
                now = time.perf_counter()
                if _has_content(ev, endpoint):
                    res.chunk_times.append(now)
                usage = ev.get("usage")
                if usage:
                    res.usage_reported = True
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_tokens = usage.get("prompt_tokens")
        end = time.perf_counter()
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return res
    if not done:
        res.error = "the stream ended without [DONE]"
        return res
    if not res.chunk_times:
        res.error = "no output chunk arrived"
        return res
    if not res.usage_reported:
        res.output_tokens = len(res.chunk_times)  # a server without usage: one token a chunk
    res.ttft = res.chunk_times[0] - res.start
    res.e2el = end - res.start
    res.ok = True
    return res


def _error_text(r) -> str:
    try:
        err = r.json().get("error")
        if isinstance(err, dict):
            return str(err.get("message"))[:300]
    except (ValueError, AttributeError):
        pass
    return r.text[:300]
