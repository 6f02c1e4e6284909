"""AsyncLLMEngine: one background thread steps an LLMEngine while asyncio callers stream results.

Every call into the engine (add, abort, step, stats) happens on that one thread, so the engine itself
needs no locking. Callers talk to it through a command queue; the thread applies pending commands
between steps, which is what bounds an abort to "within one step". Results travel back with
``loop.call_soon_threadsafe`` into a per-request ``RequestStream`` that keeps only the latest
(cumulative) output, so a slow reader costs memory O(1) per request, never a backlog.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from turnout.engine.async_rl import AsyncRolloutMixin
from turnout.engine.llm_engine import EngineStats
from turnout.engine.outputs import RequestOutput
from turnout.engine.sampling_params import SamplingParams
from turnout.engine.stats_log import StatsLogger

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests are waiting than --max-queue allows; nothing of the request was admitted."""


class EngineDeadError(RuntimeError):
    """The engine failed; every in-flight request gets this, and so does every new one."""


class EngineDraining(RuntimeError):
    """The server is shutting down and accepts no new requests."""


class EngineUnavailable(RuntimeError):
    """The engine is asleep or its generation is paused (the RL control plane): retry after wake_up /
    resume. Nothing of the request was admitted."""


class EngineObserver:
    """Per-request latency hooks, called on the engine thread (the server plugs Prometheus in here)."""

    def on_first_token(self, ttft_s: float) -> None: ...

    def on_inter_token(self, itl_s: float, num_tokens: int) -> None: ...

    def on_finished(self, e2e_s: float, finish_reason: str) -> None: ...



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
class _Tracked:
    stream: RequestStream
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    outputs: dict | None = None  # completion index -> CompletionOutput (merged across steps)


class AsyncLLMEngine(AsyncRolloutMixin):
    """The server's engine: one thread steps it; the RL control plane (pause / resume, sleep / wake, weight
    updates) runs as commands on that thread between steps (turnout/engine/async_rl.py)."""

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
        self._tracked: dict[str, _Tracked] = {}
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
                self._tracked[rid] = _Tracked(stream, now, outputs={})
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

    # ---------------------------------------------------------------- engine thread
    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        engine = self.engine
        rl = getattr(engine, "rl", None)  # the RL control plane (an engine without one never pauses)
        try:
            while not self._stop:
                # paused with mode "keep": the requests wait, the thread waits for commands (no spinning)
                busy = engine.has_unfinished_requests() and (rl is None or rl.paused is None)
                added, aborted = self._apply_commands(block=not busy)
                self._publish_stats(added, aborted)  # before the step: a step may take a while
                if engine.has_unfinished_requests() and (rl is None or rl.paused is None):
                    self._deliver(engine.step())
                    self._publish_stats(0, 0)
            self._publish_stats(*self._apply_commands(block=False))  # aborts queued by shutdown()
        except BaseException as e:  # noqa: BLE001 - any failure of the engine kills it, loudly
            logger.exception("engine failed; failing every in-flight request")
            self._die(e)

    def _apply_commands(self, block: bool) -> int:
        cmds = []
        try:
            cmds.append(self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait())
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        added = aborted = 0
        for cmd in cmds:
            if cmd[0] == "add":
                _, rid, prompt, params, stream = cmd
                added += 1
                with self._lock:
                    live = rid in self._tracked
                if not live:  # aborted before it reached the engine
                    continue
                try:
                    if self.unavailable is not None:  # paused or put to sleep after the caller's check
                        raise EngineUnavailable(self.unavailable)
                    self.engine.add_request(rid, prompt, params, arrival_time=time.time())
                except Exception as e:  # noqa: BLE001 - a bad request must not kill the engine
                    with self._lock:
                        self._tracked.pop(rid, None)
                    self._call_soon(stream._fail, e)
                    continue
                self._call_soon(stream._added)
            elif cmd[0] == "abort":
                _, rid, t = cmd
                try:
                    self.engine.abort_request(rid)
                except (KeyError, ValueError):  # it finished (or never got in) meanwhile
                    pass
                aborted += 1
                self.observer.on_finished(time.monotonic() - t.arrival, "abort")
            elif cmd[0] == "call":  # the RL control plane: between two steps, on this thread
                _, fn, fut = cmd
                result, error = None, None
                try:
                    result = fn()
                except Exception as e:  # noqa: BLE001 - the caller's error (a bad path, asleep, ...)
                    error = e
                # before the caller hears back: a request it sends next (after wake_up) sees the new state
                self.unavailable = _unavailable(getattr(self.engine, "rl", None))
                self._call_soon(_settle, fut, result, error)
        return added, aborted

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            with self._lock:
                t = self._tracked.get(out.request_id)
                if t is not None and out.finished:
                    del self._tracked[out.request_id]
            if t is None:  # aborted meanwhile
                continue
            for o in out.outputs:  # snapshot: the engine may keep mutating its own lists
                t.outputs[o.index] = dataclasses.replace(
                    o, token_ids=list(o.token_ids), logprobs=None if o.logprobs is None else list(o.logprobs))
            merged = dataclasses.replace(out, outputs=[t.outputs[i] for i in sorted(t.outputs)],
                                         prompt_token_ids=out.prompt_token_ids)
            n = sum(len(o.token_ids) for o in merged.outputs)
            if n > t.num_tokens:
                if t.first_token is None:
                    t.first_token = now
                    self.observer.on_first_token(now - t.arrival)
                else:
                    self.observer.on_inter_token((now - t.last_token) / (n - t.num_tokens), n - t.num_tokens)
                t.last_token, t.num_tokens = now, n
            if out.finished:
                reason = next((o.finish_reason for o in merged.outputs if o.finish_reason), "stop")
                self.observer.on_finished(now - t.arrival, reason)
            self._call_soon(t.stream._put, merged)

    def _publish_stats(self, added: int, aborted: int) -> None:
        self.last_loop = time.monotonic()
        snap = self.engine.get_stats()  # a fresh EngineStats each call
        if self._stats_log is not None:
            self._stats_log.observe(snap)
        with self._lock:
            self.stats = snap
            self._unaccounted -= added
            self._aborting -= aborted

    def _die(self, exc: BaseException) -> None:
        """A fault no request owns: nothing the engine holds can be trusted any more. Every waiting caller
        gets an error now, the gauges read zero (nothing runs), and ``on_dead`` tells the server, which
        exits non-zero so that its supervisor restarts it."""
        self.dead = exc
        err = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
        with self._lock:
            tracked, self._tracked = list(self._tracked.values()), {}
            self._unaccounted = self._aborting = 0
            self.stats = EngineStats()
        for t in tracked:
            self._call_soon(t.stream._fail, err)
        # Commands that raced in after the failure: fail their streams too.
        try:
            while True:
                cmd = self._commands.get_nowait()
                if cmd[0] == "add":
                    self._call_soon(cmd[4]._fail, err)
        except queue.Empty:
            pass
        if self.on_dead is not None:
            self._call_soon(self.on_dead, exc)


def _settle(fut: asyncio.Future, result, exc: BaseException | None) -> None:
    if not fut.done():
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)


def _unavailable(rl) -> str | None:
    """Why a new request cannot be admitted now (RolloutControl's state), or None."""
    if rl is None:
        return None
    try:
        rl.check_can_admit()
    except RuntimeError as e:
        return str(e)
    return None
