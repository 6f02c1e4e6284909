"""Where the server builds and compiles grammars: worker threads in two lanes, with a deadline.

Threads, not processes, because xgrammar releases the GIL while it works. Measured with xgrammar 0.2.9
on the SmolLM2 vocabulary, an event loop sleeping 10 ms at a time in the main thread: while a worker
thread built the grammar of a schema ``pattern`` ``b{1,8000}`` (3.6 s) the loop's worst sleep took
15 ms; while one compiled a 20000-value enum (2.1 s) 14 ms. A child process would add a copy of
the result for nothing: the same compiled enum (83 MB) takes 6.4 s to serialise and 1.5 s to read
back, three times its compile.

A thread cannot be stopped, so a deadline (and a client that leaves) stops the *wait*: the request is
answered at once, a job still waiting for a slot never starts, and a job already running finishes in
the background (its result is cached). What bounds such a job is the pre-check
(turnout/structured/limits.py). An abandoned job gives its slot back at once, up to ``max_abandoned``
of them a lane, so that abandoned compiles cannot take a lane's slots away; past that they keep their
slots until they end, which bounds the CPU they can burn. And so that compiles left running by large
requests can never make a small one wait, requests go to one of two lanes: the light lane takes only
specs that compile in milliseconds whatever they say (a small body, few JSON values, little regex
repetition: ``limits.is_light``), so a trivial ``guided_choice`` waits only behind other such specs;
everything else shares the heavy lane. The threads are daemons: a server that exits does not wait for
a compile nobody wants.
"""

from __future__ import annotations

import asyncio
import threading

LIGHT_BODY_BYTES = 8 << 10  # a request body larger than this never goes to the light lane


class GrammarTimeout(TimeoutError):
    """The work did not finish within its deadline."""


class Disconnected(Exception):
    """The client went away while its grammar was being built."""


class _Lane:
    def __init__(self, name: str, threads: int, max_abandoned: int):
        self.name, self.threads, self.max_abandoned = name, threads, max_abandoned
        self.free = threads  # slots not held by a running job that someone waits for (or a kept one)
        self.abandoned = 0  # abandoned jobs still running that gave their slot back
        self._waiters: list[asyncio.Future] = []

    async def acquire(self) -> None:
        while self.free <= 0:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # woken, then cancelled: pass the wake-up on
                    self._wake_next()
                raise
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
        self.free -= 1

    def release(self) -> None:
        self.free += 1
        self._wake_next()

    def _wake_next(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
                break


class GrammarWorkers:
    def __init__(self, light_threads: int = 2, heavy_threads: int = 2, max_abandoned: int = 2):
        self._lanes = {True: _Lane("grammar-light", light_threads, max_abandoned),
                       False: _Lane("grammar-heavy", heavy_threads, max_abandoned)}

    async def run(self, fn, *, light: bool, timeout: float, gone: asyncio.Future | None = None):
        """``fn()`` on a worker thread of the light or heavy lane; GrammarTimeout after ``timeout``
        seconds (waiting for a slot included), Disconnected when ``gone`` (a future that completes when
        the client leaves) completes first."""
        loop = asyncio.get_running_loop()
        lane = self._lanes[light]
        deadline = loop.time() + timeout
        slot = asyncio.ensure_future(lane.acquire())
        got = False
        try:
            got = await self._wait(slot, gone, deadline)
        finally:
            if not slot.done() or not got:  # hand back a slot acquired too late (or when cancelled)
                slot.cancel()
                slot.add_done_callback(_release_if_acquired(lane))
        if not got:
            raise self._why(gone, timeout)
        job = loop.create_future()
        state = {"abandoned": False}

        def finished(ok: bool, value) -> None:  # on the loop
            if state["abandoned"] == "zombie":
                lane.abandoned -= 1
            elif state["abandoned"] == "kept" or not state["abandoned"]:
                lane.release()
            if not job.done():
                (job.set_result if ok else job.set_exception)(value)
            if state["abandoned"] and not job.cancelled():
                job.exception()  # read: nobody waits for it any more

        def work() -> None:
            try:
                value, ok = fn(), True
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                value, ok = e, False
            loop.call_soon_threadsafe(finished, ok, value)

        threading.Thread(target=work, name=lane.name, daemon=True).start()
        if await self._wait(job, gone, deadline):
            return job.result()
        if job.done():  # it finished, but the client left: its slot is back already
            raise self._why(gone, timeout)
        if lane.abandoned < lane.max_abandoned:  # give the slot back now; the job runs on without one
            state["abandoned"] = "zombie"
            lane.abandoned += 1
            lane.release()
        else:  # too many already: this one keeps its slot until it ends
            state["abandoned"] = "kept"
        raise self._why(gone, timeout)

    @staticmethod
    async def _wait(fut: asyncio.Future, gone: asyncio.Future | None, deadline: float) -> bool:
        """Whether ``fut`` completed before ``gone`` and before the deadline."""
        waiting = {fut} if gone is None else {fut, gone}
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        return fut in done and not (gone is not None and gone in done)

    @staticmethod
    def _why(gone: asyncio.Future | None, timeout: float) -> Exception:
        if gone is not None and gone.done():
            return Disconnected()
        return GrammarTimeout(f"did not finish within {timeout:g} s")

    def shutdown(self) -> None:
        """Nothing to join: the threads are daemons and each ends with its job."""


def _release_if_acquired(lane: _Lane):
    def callback(f: asyncio.Future) -> None:
        if not f.cancelled() and f.exception() is None:
            lane.release()
    return callback
