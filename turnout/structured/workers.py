"""Where the server builds and compiles grammars: worker threads in two lanes, with a deadline.

Threads, not processes, because xgrammar releases the GIL while it works. Measured with xgrammar 0.2.9
on the SmolLM2 vocabulary, an event loop sleeping 10 ms at a time in the main thread: while a worker
thread built the grammar of a schema ``pattern`` ``b{1,8000}`` (3.6 s) the loop's worst sleep took
15 ms; while one compiled a 20000-value enum (2.1 s) 14 ms. A child process would add a copy of
the result for nothing: the same compiled enum (83 MB) takes 6.4 s to serialise and 1.5 s to read
back, three times its compile.

A thread cannot be stopped, so a deadline (and a client that leaves) stops the *wait*: the request is
answered at once, a job still queued is dropped before it starts, and a job already running finishes
in the background, its result cached. What bounds such a job is the pre-check
(turnout/structured/limits.py), which keeps any accepted spec to well under a second of work. And
so that compiles left running by large requests can never make a small one wait, requests go to one
of two lanes: the light lane takes only specs that compile in milliseconds whatever they say (a small
body, few JSON values, little regex repetition: ``limits.is_light``), so a trivial ``guided_choice``
waits only behind other such specs; everything else shares the heavy lane.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

LIGHT_BODY_BYTES = 8 << 10  # a request body larger than this never goes to the light lane


class GrammarTimeout(TimeoutError):
    """The work did not finish within its deadline."""


class Disconnected(Exception):
    """The client went away while its grammar was being built."""


class GrammarWorkers:
    def __init__(self, light_threads: int = 2, heavy_threads: int = 2):
        self._light = ThreadPoolExecutor(light_threads, thread_name_prefix="grammar-light")
        self._heavy = ThreadPoolExecutor(heavy_threads, thread_name_prefix="grammar-heavy")

    async def run(self, fn, *, light: bool, timeout: float, gone: asyncio.Future | None = None):
        """``fn()`` on a worker thread of the light or heavy lane; GrammarTimeout after ``timeout``
        seconds, Disconnected when ``gone`` (a future that completes when the client leaves) completes
        first. Either way a job that has not started is cancelled."""
        pool = self._light if light else self._heavy
        job = asyncio.get_running_loop().run_in_executor(pool, fn)
        waiting = {job} if gone is None else {job, gone}
        done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if gone is not None and gone in done:  # checked first: a client that left is not answered anyway
            job.cancel()
            job.add_done_callback(_swallow)
            raise Disconnected()
        if job in done:
            return job.result()
        job.cancel()  # a queued job never starts; a running one ends on its own (its result is cached)
        job.add_done_callback(_swallow)
        raise GrammarTimeout(f"did not finish within {timeout:g} s")

    def shutdown(self) -> None:
        for pool in (self._light, self._heavy):
            pool.shutdown(wait=False, cancel_futures=True)


def _swallow(fut: asyncio.Future) -> None:
    """A job nobody waits for any more: read its outcome so asyncio does not log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()
