"""What runs the model for the engine core: ``uniproc`` (one rank, in-process: today's path) or ``mp`` (a
tensor-parallel engine, rank 0 in the engine process and a spawned process per other rank). Each offers
``runner`` (the ModelExecutor the core drives), ``loaded``, ``num_blocks`` and ``collective_rpc``."""

from __future__ import annotations

BACKENDS = ("uniproc", "mp")


def make_executor(config, platform, ops):
    backend = config.distributed_executor_backend or ("uniproc" if config.tensor_parallel_size == 1 else "mp")
    if backend == "uniproc":
        if config.tensor_parallel_size != 1:
            raise ValueError(f"distributed_executor_backend: uniproc runs one rank, but tensor_parallel_size is "
                             f"{config.tensor_parallel_size}; use mp")
        from turnout.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config, platform, ops)
    from turnout.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, platform, ops)
