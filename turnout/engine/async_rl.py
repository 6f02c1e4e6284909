"""The RL control plane on the server's engine (``AsyncLLMEngine``): pause / resume, sleep / wake, weight
updates, prefix-cache reset, as coroutines.

Each call is a command on the engine thread's queue, run between two steps (the thread that steps the
engine is the only one that touches it, as for add and abort), and its result or exception comes back to
the awaiting caller. Calls that change the weights run paused (pause "keep" -> do -> resume, unless the
caller paused already), so no step mixes old and new weights on the host side; a lookahead step already
launched under async scheduling finishes with the weights it started with (one token). Waiting for a
trainer to appear (``init_weight_update_group``) happens off that thread, under the caller's timeout.
``pause_generation("abort")`` ends every in-flight request with ``finish_reason == "abort"`` and its
partial tokens and logprobs, delivered to its stream; "keep" freezes them until ``resume_generation()``.
While asleep or paused, new requests are refused with ``EngineUnavailable`` (a 503 on the server).
"""

from __future__ import annotations

import asyncio

from turnout.engine.outputs import RequestOutput
from turnout.engine.rl import PAUSE_MODES


class AsyncRolloutMixin:
    """Mixed into AsyncLLMEngine: needs its ``engine``, ``_commands``, ``_loop``, ``_deliver`` and ``dead``."""

    async def _on_engine(self, fn):
        if self.dead is not None:
            raise RuntimeError(f"the engine has failed: {self.dead}")
        assert self._loop is not None, "AsyncLLMEngine.start() was not called"
        fut = self._loop.create_future()
        self._commands.put(("call", fn, fut))
        return await asyncio.shield(fut)

    def _while_paused(self, fn):
        """``fn`` with generation paused ("keep") around it, unless it already was."""
        rl = self.engine.rl

        def run():
            was = rl.paused
            if was is None:
                rl.pause_generation("keep")
            try:
                return fn()
            finally:
                if was is None:
                    rl.resume_generation()

        return run

    # ---- pause / resume ------------------------------------------------------------------------
    async def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        """"abort": every in-flight request ends now (finish_reason "abort", its partial output delivered);
        "keep": they stay where they are. Returns the aborted outputs. New requests are refused until
        ``resume_generation``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {list(PAUSE_MODES)}, got {mode!r}")

        def run():
            outs = self.engine.pause_generation(mode)
            self._deliver(outs)
            return outs

        return await self._on_engine(run)

    async def resume_generation(self) -> None:
        await self._on_engine(self.engine.resume_generation)

    def is_paused(self) -> bool:
        return self.engine.rl.paused is not None

    # ---- memory --------------------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """Needs no request in flight (pause with mode "abort" first): RuntimeError naming the count."""
        await self._on_engine(lambda: self.engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._on_engine(lambda: self.engine.wake_up(tags))

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    # ---- weights -------------------------------------------------------------------------------
    async def update_weights(self, weights) -> list[str]:
        return await self._on_engine(self._while_paused(lambda: self.engine.update_weights(weights)))

    async def update_weights_from_disk(self, path: str) -> list[str]:
        return await self._on_engine(self._while_paused(lambda: self.engine.update_weights_from_disk(path)))

    async def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                       world_size: int, backend: str = "gloo", timeout: float | None = None
                                       ) -> list[int]:
        """Waits for the trainer's store on a thread of its own (the engine keeps stepping: a wrong port
        costs the caller its ``timeout``, never the other requests), then joins on the engine thread."""
        rl = self.engine.rl
        args = (master_address, master_port, rank_offset, world_size, backend)
        deadline = await asyncio.to_thread(rl.wait_for_trainer, *args, timeout)
        return await self._on_engine(lambda: rl.join_weight_update_group(*args, deadline))

    async def update_weights_from_distributed(self, names, dtypes, shapes, timeout: float | None = None) -> list[str]:
        return await self._on_engine(self._while_paused(
            lambda: self.engine.update_weights_from_distributed(names, dtypes, shapes, timeout)))

    async def reset_prefix_cache(self) -> int:
        return await self._on_engine(self.engine.reset_prefix_cache)

    # ---- per-rank calls --------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.engine.executor.world_size

    async def collective_rpc(self, method, args=(), kwargs=None, writes_weights: bool = False) -> list:
        """``method`` (a callable taking the worker first, or a Worker method name) on every rank, on the engine
        thread between two steps; each rank's result. ``writes_weights``: it writes weights, so it runs with
        generation paused and every cached prefix is forgotten after (the KV was computed with the old ones)."""
        def run():
            out = self.engine.executor.collective_rpc(method, args, kwargs)
            if writes_weights:
                self.engine.reset_prefix_cache()
            return out

        return await self._on_engine(self._while_paused(run) if writes_weights else run)
