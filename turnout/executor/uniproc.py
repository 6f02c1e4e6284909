"""The in-process executor: one rank, today's path. The engine core drives the rank's ModelRunner itself
(``runner``), so a step costs exactly what it cost before the executor existed: no IPC, no indirection."""

from __future__ import annotations


class UniprocExecutor:
    def __init__(self, config, platform, ops):
        from turnout.worker.worker import Worker

        self.worker = Worker(config, platform=platform, ops=ops)
        self.loaded = self.worker.loaded
        self.runner = self.worker.runner  # what the engine core calls execute on
        self.num_blocks = self.runner.num_blocks
        self.world_size = 1

    def driver_rpc(self, method: str, *args):
        """A Worker method on the driver rank only, in this process: a check that must pass before any rank
        is asked to act (the others would only repeat it)."""
        return getattr(self.worker, method)(*args)

    def collective_rpc(self, method, args=(), kwargs=None) -> list:
        """``method`` (a Worker method name, or a callable taking the worker first) on the one worker."""
        fn = getattr(self.worker, method) if isinstance(method, str) else (lambda *a, **k: method(self.worker, *a, **k))
        return [fn(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        pass
