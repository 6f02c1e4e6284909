"""What runs the model for the engine core: ``uniproc`` (one rank, in-process: today's path), ``mp`` (a
tensor-parallel engine, rank 0 in the engine process and a spawned process per other rank; with
``nnodes > 1`` the other nodes' ranks join over TCP, executor/multinode.py) or ``ray`` (ranks 1.. as Ray
actors in a placement group, executor/ray_executor.py). Each offers ``runner`` (the ModelExecutor the core
drives), ``loaded``, ``num_blocks`` and ``collective_rpc``."""

from __future__ import annotations

BACKENDS = ("uniproc", "mp", "ray")


def make_executor(config, platform, ops):
    backend = config.distributed_executor_backend or ("uniproc" if config.tensor_parallel_size == 1 else "mp")
    if config.node_rank != 0:
        raise ValueError(f"node_rank: node {config.node_rank} runs no engine (only node 0 does); start it with "
                         "`turnout serve ... --headless`")
    if backend == "uniproc":
        if config.tensor_parallel_size != 1:
            raise ValueError(f"distributed_executor_backend: uniproc runs one rank, but tensor_parallel_size is "
                             f"{config.tensor_parallel_size}; use mp")
        from turnout.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config, platform, ops)
    from turnout.executor.multiproc import MultiprocExecutor

    if backend == "ray":
        from turnout.executor.ray_executor import RayRanks

        return MultiprocExecutor(config, platform, ops, remote=RayRanks(config, platform))
    if config.nnodes > 1:
        from turnout.executor.multinode import HeadRendezvous

        return MultiprocExecutor(config, platform, ops, remote=HeadRendezvous(config))
    return MultiprocExecutor(config, platform, ops)
