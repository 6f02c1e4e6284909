"""The mp executor's view of its local ranks' health: which rank died, which one hangs.

Each spawned rank writes two numbers into arrays shared with the engine process (turnout/worker/lifecycle.py
and ``Worker.serve``): its heartbeat (the time, every 0.25 s, from a thread of its own) and the steps it has
finished. A rank that died has an exit code. A rank that is frozen (SIGSTOP, a deadlock that holds the GIL)
stops beating; a rank that merely waits in a collective for a frozen peer keeps beating. So when a step
overruns ``distributed_timeout_s`` (the step watchdog), or fails (the TP group's own collective timeout,
a peer's reset), the ranks to blame are: those that died, else those that stopped beating, else those
that did not finish the step. The watchdog kills the ranks it blames, so that every collective waiting on
them fails at once (their sockets reset) instead of hanging, and the step's error names them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from multiprocessing.connection import wait

logger = logging.getLogger(__name__)


class RankHealth:
    def __init__(self, ctx, world: int, timeout_s: float):
        self.progress = ctx.Array("q", world, lock=False)  # steps finished, per rank (rank 0's slot unused)
        self.beats = ctx.Array("d", world, lock=False)  # time.monotonic() of each rank's last heartbeat
        self.timeout_s = timeout_s
        self.stale_s = min(5.0, max(1.0, timeout_s / 2))  # no beat for this long: frozen
        self.procs: list = []  # the local ranks' processes, rank 1.. in order
        self.steps = 0  # steps the driver has sent its ranks
        self._step_started: float | None = None
        self._verdicts: dict[int, str] = {}  # rank -> why the watchdog killed it
        self._lock = threading.Lock()
        self._closed = False

    @property
    def shared(self):
        return self.progress, self.beats

    # ---- the driver's steps ------------------------------------------------------------------
    def step_published(self) -> None:
        self.steps += 1

    def step_started(self) -> None:
        self._step_started = time.monotonic()

    def step_ended(self) -> None:
        self._step_started = None

    def start_watchdog(self) -> None:
        threading.Thread(target=self._watch, daemon=True, name="turnout-step-watchdog").start()

    def close(self) -> None:
        self._closed = True

    def _watch(self) -> None:
        while not self._closed:
            time.sleep(0.25)
            started = self._step_started
            if started is None or time.monotonic() - started < self.timeout_s:
                continue
            blamed = self.blame(overran=True)
            if blamed:
                logger.error("step watchdog: step %d ran past %.0fs (distributed_timeout_s): %s", self.steps,
                             self.timeout_s, blamed)
                self._step_started = None  # the step will now fail; say it once

    # ---- who is to blame ---------------------------------------------------------------------
    def blame(self, overran: bool = False, reap_s: float = 0.0) -> str | None:
        """A sentence naming the ranks to blame for a step that failed (or, ``overran``, ran past the
        timeout), or None. Frozen ranks are killed (so are, when the step overran, ranks that did not finish
        it): the collectives waiting on them then fail at once. ``reap_s``: wait this long for a rank whose
        pipe closed to be reaped (a peer's reset can arrive before its exit code)."""
        with self._lock:
            if reap_s:
                gone = set(wait([p.sentinel for p in self.procs], timeout=reap_s))
                for p in self.procs:
                    if p.sentinel in gone:
                        p.join(timeout=2.0)
            now = time.monotonic()
            dead, frozen, behind = [], [], []
            for rank, p in enumerate(self.procs, start=1):
                if rank in self._verdicts:
                    continue
                if p.exitcode is not None:
                    dead.append(f"rank {rank} (pid {p.pid}, exit code {p.exitcode}) died")
                elif now - self.beats[rank] > self.stale_s:
                    frozen.append((rank, p, f"rank {rank} (pid {p.pid}) hung: no heartbeat for "
                                            f"{now - self.beats[rank]:.0f}s"))
                elif self.progress[rank] < self.steps:
                    behind.append((rank, p, f"rank {rank} (pid {p.pid}) hung: step {self.steps} not finished "
                                            f"within {self.timeout_s:g}s (distributed_timeout_s)"))
            for rank, p, why in frozen or (behind if overran and not dead else []):
                self._verdicts[rank] = why + ", killed by the step watchdog"
                _kill(p)
            words = dead + [self._verdicts[r] for r in sorted(self._verdicts)]
            return "; ".join(words) if words else None


def _kill(p) -> None:
    try:
        os.kill(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.join(timeout=5.0)
