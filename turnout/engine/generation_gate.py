"""How another thread pauses or aborts ``LLM.generate``, which steps the engine in the caller's own thread
(the server's engine has a thread of its own and takes such calls as commands: turnout/engine/async_rl.py)."""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

from turnout.engine.outputs import RequestOutput
from turnout.engine.rl import PAUSE_MODES


class GenerationGate:
    """How another thread pauses or aborts ``LLM.generate`` (which steps the engine in the caller's thread):
    it asks, and the generate loop honours the ask between two steps (``checkpoint``), so the engine is only
    ever touched by one thread at a time. ``pause("keep")`` returns once the loop is parked; the asking
    thread may then update weights, and ``resume`` lets the loop go on. With no generate running an ask is
    applied at once."""

    def __init__(self, engine):
        # a proxy, not a reference: the engine holds this object, and a cycle would keep a dropped engine
        # (its weights and KV cache, GiBs on a GPU) alive until the cyclic garbage collector runs
        self.engine = weakref.proxy(engine)
        self._cv = threading.Condition()
        self._running = False
        self._parked = False
        self._ask: str | None = None
        self._answer: list[RequestOutput] = []
        self._aborted_while_parked: list[RequestOutput] = []

    @contextmanager
    def generating(self):
        with self._cv:
            self._running = True
        try:
            yield
        finally:
            with self._cv:
                self._running = False
                if self._ask is not None:  # asked after the loop's last checkpoint: answered now, idle
                    self._answer, self._ask = self.engine.rl.pause_generation(self._ask), None
                self._cv.notify_all()

    def checkpoint(self) -> list[RequestOutput]:
        """The generate loop, between steps: honour a pending ask. Returns the outputs it aborted."""
        if self._ask is None:  # an unlocked read: an ask that races it is seen at the next step
            return []
        with self._cv:
            ask, self._ask = self._ask, None
            if ask is None:
                return []
            self._answer = out = self.engine.rl.pause_generation(ask)
            self._cv.notify_all()
            if ask == "keep":
                self._parked = True
                while self.engine.rl.paused == "keep":
                    self._cv.wait()
                self._parked = False
                out, self._aborted_while_parked = out + self._aborted_while_parked, []
            return out

    def pause(self, mode: str) -> list[RequestOutput]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {list(PAUSE_MODES)}, got {mode!r}")
        with self._cv:
            if not self._running or self._parked:
                out = self.engine.rl.pause_generation(mode)
                if self._parked:  # the parked loop collects its aborted requests too
                    self._aborted_while_parked.extend(out)
                    self._cv.notify_all()
                return out
            self._ask = mode
            while self._ask is not None:
                self._cv.wait()
            return self._answer

    def resume(self) -> None:
        with self._cv:
            self.engine.rl.resume_generation()
            self._cv.notify_all()

    def check_quiet(self, what: str) -> None:
        """``what`` touches the engine: refuse while a generate loop runs in another thread and is not parked."""
        if self._running and not self._parked:
            raise RuntimeError(f"{what}: a generate() call is running; pause_generation() (or "
                               "abort_all_requests()) first")
