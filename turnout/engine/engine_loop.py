"""The engine thread of the server's engine (``AsyncLLMEngine``): the loop that applies the callers'
commands between steps, steps the ``LLMEngine``, delivers each output to its request's stream, publishes
the stats, and fails every request when the engine dies.

Every call into the engine (add, abort, step, stats, the RL control plane's calls) happens on this one
thread, so the engine itself needs no locking; applying the pending commands between two steps is what
bounds an abort to "within one step". Results go back with ``loop.call_soon_threadsafe``. Separate from
engine/async_engine.py, the callers' side (admission, abort, shutdown), because the two run on different
threads and share only the command queue and the lock-guarded request table.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import time

from turnout.engine.async_errors import EngineDeadError, EngineUnavailable
from turnout.engine.core_outputs import EngineStats
from turnout.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineLoopMixin:
    """Mixed into AsyncLLMEngine: needs its ``engine``, ``observer``, ``_commands``, ``_lock`` (guarding
    ``_tracked``, ``_unaccounted``, ``_aborting`` and ``stats``), ``_loop``, ``_stop``, ``_idle_poll_s``,
    ``_stats_log``, ``unavailable``, ``last_loop``, ``dead`` and ``on_dead``."""

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

    def _apply_commands(self, block: bool) -> tuple[int, int]:
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
