"""One request in flight on the server's engine: the caller's ``RequestStream`` and the engine's record of
it (``TrackedRequest``).

The stream keeps only the latest cumulative output, so a slow reader costs memory O(1) per request, never
a backlog. Separate from engine/async_engine.py because both the callers' side and the engine thread
(engine/engine_loop.py) hold these, and they need nothing of either.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from turnout.engine.outputs import RequestOutput


class RequestStream:
    """The caller's side of one request: ``async for out in stream`` yields cumulative outputs."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._loop = loop
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._done = False  # a finished output was delivered, or the request was aborted
        self._event = asyncio.Event()
        self.added: asyncio.Future = loop.create_future()  # engine.add_request's result

    # -- engine side (always run on the event loop via call_soon_threadsafe) --
    def _put(self, out: RequestOutput) -> None:
        if not self._done:
            self._latest = out
            self._event.set()

    def _fail(self, exc: BaseException) -> None:
        if not self.added.done():
            self.added.set_exception(exc)
            self.added.exception()  # mark retrieved: nobody may be awaiting it any more
        if not self._done:
            self._error = exc
            self._event.set()

    def _added(self) -> None:
        if not self.added.done():
            self.added.set_result(None)

    def _close(self) -> None:
        self._done = True
        self._event.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                if out.finished:
                    self._done = True
                return out
            if self._error is not None:
                err, self._error = self._error, None
                self._done = True
                raise err
            if self._done:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()


@dataclass
class TrackedRequest:
    """The engine's record of a request in flight: its stream, the times the observer measures from, and
    its outputs merged across steps (a step reports only the samples that moved)."""

    stream: RequestStream
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    outputs: dict | None = None  # completion index -> CompletionOutput (merged across steps)
