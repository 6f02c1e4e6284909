"""AsyncLLMEngine: one background thread steps an LLMEngine while asyncio callers stream results.

Every call into the engine (add, abort, step, stats) happens on that one thread (engine/engine_loop.py),
so the engine itself needs no locking. Callers talk to it through a command queue; the thread applies
pending commands between steps, which is what bounds an abort to "within one step". Results travel back
into a per-request ``RequestStream`` (engine/request_stream.py) that keeps only the latest (cumulative)
output. This module is the callers' side: admission (all or nothing, against the queue bound), abort,
draining and shutdown; the RL control plane's calls are engine/async_rl.py.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Callable

from turnout.engine.async_errors import EngineDeadError, EngineDraining, EngineUnavailable, QueueFull
from turnout.engine.async_rl import AsyncRolloutMixin
from turnout.engine.engine_loop import EngineLoopMixin
from turnout.engine.llm_engine import EngineStats
from turnout.engine.request_stream import RequestStream, TrackedRequest
from turnout.engine.sampling_params import SamplingParams
from turnout.engine.stats_log import StatsLogger

logger = logging.getLogger(__name__)


class EngineObserver:
    """Per-request latency hooks, called on the engine thread (the server plugs Prometheus in here)."""

    def on_first_token(self, ttft_s: float) -> None: ...

    def on_inter_token(self, itl_s: float, num_tokens: int) -> None: ...

    def on_finished(self, e2e_s: float, finish_reason: str) -> None: ...


class AsyncLLMEngine(EngineLoopMixin, AsyncRolloutMixin):
    """The server's engine: one thread steps it (turnout/engine/engine_loop.py); the RL control plane (pause /
    resume, sleep / wake, weight updates) runs as commands on that thread between steps
    (turnout/engine/async_rl.py)."""

    def __init__(self, engine, *, max_queue: int = 1024, max_num_seqs: int = 256,
                 observer: EngineObserver | None = None, idle_poll_s: float = 0.5,
                 on_dead: Callable[[BaseException], None] | None = None, log_stats_interval_s: float | None = 10.0):
        """``log_stats_interval_s``: the periodic stats line's window (turnout/engine/stats_log.py); None: off."""
        self.engine = engine
        self._stats_log = StatsLogger(log_stats_interval_s) if log_stats_interval_s else None
        self.on_dead = on_dead  # called on the event loop once the engine thread has died
        self.max_queue = max_queue
        self.max_num_seqs = max_num_seqs
        self.observer = observer or EngineObserver()
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _tracked, _unaccounted, stats
        self._tracked: dict[str, TrackedRequest] = {}
        self._unaccounted = 0  # admitted requests not yet visible in `stats`
        self._aborting = 0  # aborted by the caller, not yet freed by the engine thread
        self.stats = EngineStats()
        self.dead: BaseException | None = None
        self.draining = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.unavailable: str | None = None  # why admission is refused now (asleep / paused), set on the engine thread
        self.last_loop = time.monotonic()  # the engine thread's last turn of its loop (/health: a stalled engine)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "AsyncLLMEngine":
        """Start the engine thread; call from inside the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="turnout-engine", daemon=True)
        self._thread.start()
        return self

    @property
    def is_running(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not yet finished, including aborted ones the engine has not freed yet."""
        with self._lock:
            return len(self._tracked) + self._aborting

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if the timeout came first."""
        deadline = time.monotonic() + timeout
        while self.num_in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish (up to drain_timeout), abort the rest, stop."""
        self.start_draining()
        if not await self.wait_idle(drain_timeout):
            with self._lock:
                left = list(self._tracked)
            logger.warning("drain timeout (%.1fs): aborting %d request(s)", drain_timeout, len(left))
            for rid in left:
                self.abort(rid, error=EngineDraining("the server shut down before the request finished"))
        self._stop = True
        self._commands.put(("wake",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    # ---------------------------------------------------------------- requests
    async def add_requests(self, items: list[tuple[str, str | list[int], SamplingParams]]) -> list[RequestStream]:
        """Admit all of ``items`` or none: QueueFull / EngineDraining / EngineDeadError before anything is
        queued; a ValueError from the engine (bad prompt) aborts the ones already added and is re-raised."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead}")
        if self.draining:
            raise EngineDraining("the server is shutting down")
        if self.unavailable is not None:
            raise EngineUnavailable(self.unavailable)
        assert self._loop is not None, "AsyncLLMEngine.start() was not called"
        now = time.monotonic()
        with self._lock:
            for rid, _, _ in items:
                if rid in self._tracked:
                    raise ValueError(f"request_id: {rid!r} is already in flight")
            s = self.stats
            capacity = self.max_queue + max(0, self.max_num_seqs - s.num_running)
            if s.num_waiting + self._unaccounted + len(items) > capacity:
                raise QueueFull(f"{s.num_waiting + self._unaccounted} requests are waiting "
                                f"(max_queue={self.max_queue}); retry later")
            streams = []
            for rid, _, _ in items:
                stream = RequestStream(rid, self._loop)
                self._tracked[rid] = TrackedRequest(stream, now, outputs={})
                streams.append(stream)
            self._unaccounted += len(items)
        for (rid, prompt, params), stream in zip(items, streams):
            self._commands.put(("add", rid, prompt, params, stream))
        if self.dead is not None:  # died between the check above and the put: nobody will answer
            for stream in streams:
                stream._fail(EngineDeadError(f"the engine has failed: {self.dead}"))
        try:
            for stream in streams:
                await asyncio.shield(stream.added)
        except BaseException:
            for stream in streams:
                self.abort(stream.request_id)
            raise
        return streams

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        return (await self.add_requests([(request_id, prompt, params)]))[0]

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams):
        """Yield cumulative RequestOutputs until finished; leaving early aborts the request."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            self.abort(request_id)  # a no-op once it finished

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Stop a request (idempotent; call on the event loop). Its stream ends at once; the engine frees
        it before its next step."""
        with self._lock:
            t = self._tracked.pop(request_id, None)
            if t is not None and self.dead is None:
                self._aborting += 1
        if t is None:
            return
        if error is not None:
            t.stream._fail(error)
        elif not t.stream.added.done():
            t.stream.added.cancel()
        t.stream._close()
        self._commands.put(("abort", request_id, t))
