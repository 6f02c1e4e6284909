"""The Ray executor (``distributed_executor_backend="ray"``): ranks 1..N-1 as Ray actors, on one machine or
many, of an existing Ray cluster (``ray start --head`` / ``ray start --address``).

The engine is the mp executor's (``MultiprocExecutor(remote=RayRanks(...))``): rank 0, the driver, stays in
the engine process with the scheduler and the sampler, and every other rank runs ``worker_main`` (its
device, its shard, its KV cache) with the same start-up phases, step messages (worker/step_codec.py: one flat
int64 buffer, never pickled) and ``collective_rpc`` as a spawned local rank. The difference is where a rank
lives and how its messages travel: Ray places each in a bundle of a placement group and starts it; its
messages go over an authenticated socket to the driver (executor/step_channel.py).

- The placement group has one bundle per rank, ``{"GPU": 1}`` on a GPU platform, else ``{"CPU": 1}``. Bundle
  0 is pinned to the driver's node (the ``node:<ip>`` resource). On a GPU a placeholder actor holds it, so Ray
  gives no other actor that GPU, and the driver runs on the one Ray assigned.
- The cluster: ``EngineConfig.ray_address`` (``--ray-address``), else whatever ``ray.init(address="auto")``
  finds (``$RAY_ADDRESS``, read by Ray, or the cluster ``ray start`` left on this machine). With none, a local
  Ray instance, which this executor also shuts down; a cluster it did not start is left running, less this
  engine's actors and placement group. (Ray puts a local instance on this machine's routable address; with
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` set before Ray is imported it stays on 127.0.0.1, as in the tests.)
- Rendezvous: torch.distributed TCP on the driver's node address as the cluster knows it (rank 0's store
  bound there only, distributed/rendezvous.py), on a free port.

Ray is optional (``pip install 'turnout[ray]'``); without it, asking for it is a ValueError that says so.
"""

from __future__ import annotations

import logging
import os

from turnout.distributed import rendezvous

logger = logging.getLogger(__name__)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend: 'ray' needs Ray, which is not installed here: "
                         "pip install 'turnout[ray]'") from None
    return ray


class _Rank:
    """One rank in a Ray actor: connect to the driver, then the same ``worker_main`` as a spawned rank; the
    call returns when the driver says quit or goes."""

    def run(self, rank, world, init_method, config, address, key, gpu, timeout_s):
        from turnout.executor.step_channel import connect
        from turnout.worker.worker import worker_main

        conn = connect(address, key, rank, timeout_s)
        worker_main(rank, world, init_method, config, conn, conn, local_rank=0 if gpu else None)
        return os.getpid()


class _Placeholder:
    """Holds bundle 0 (the driver's) on a GPU cluster and says which GPU Ray gave it."""

    def gpu_ids(self):
        import ray

        return ray.get_gpu_ids()


class RayRanks:
    """What ``MultiprocExecutor(remote=...)`` asks of remote ranks: ``driver_init_method``, ``init_method``,
    ``local_ranks`` (1: no rank is spawned by the engine), ``driver_local_rank``, ``accept()``, ``close()``."""

    local_ranks = 1

    def __init__(self, config, platform):
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from turnout.executor.step_channel import StepListener

        self._ray, self._remove_pg = ray, remove_placement_group
        self.world = world = config.tensor_parallel_size
        self.timeout_s = float(getattr(config, "distributed_timeout_s", None) or 300.0)
        self._started = _connect(ray, config, world)
        self._pg, self._actors, self._runs, self._listener = None, [], [], None
        try:
            ip = _node_ip(ray)
            gpu = platform.is_gpu
            kind = "GPU" if gpu else "CPU"
            bundles = [{kind: 1.0} for _ in range(world)]
            bundles[0][f"node:{ip}"] = 0.001  # the driver's rank runs here, in the engine process
            self._pg = placement_group(bundles, strategy="PACK", name=f"turnout-tp{world}-{os.getpid()}")
            ready, _ = ray.wait([self._pg.ready()], timeout=self.timeout_s)
            if not ready:
                raise RuntimeError(f"distributed_executor_backend: the Ray cluster could not place {world} bundles "
                                   f"of 1 {kind} (one on this node, {ip}) within {self.timeout_s:.0f}s; "
                                   f"`ray status` shows what it has")

            def at(i, cls, **res):
                return ray.remote(cls).options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=i), **res).remote()

            self.driver_local_rank = None
            if gpu:
                holder = at(0, _Placeholder, num_cpus=0, num_gpus=1)
                self._actors.append(holder)
                self.driver_local_rank = int(ray.get(holder.gpu_ids.remote(), timeout=self.timeout_s)[0])
            self.driver_init_method = rendezvous.master_store(ip, 0, self.timeout_s)  # on a free port
            self.init_method = rendezvous.init_url(ip, self.driver_init_method.port)
            self._listener = StepListener(ip)
            res = {"num_cpus": 0, "num_gpus": 1} if gpu else {"num_cpus": 1}
            for rank in range(1, world):
                actor = at(rank, _Rank, **res)
                self._actors.append(actor)
                self._runs.append(actor.run.remote(rank, world, self.init_method, config, self._listener.address,
                                                   self._listener.key, gpu, self.timeout_s))
        except BaseException:
            self.close()
            raise
        logger.info("ray executor: %d ranks on placement group %s (driver on %s)", world, self._pg.id.hex(), ip)

    def accept(self, alive=None):
        try:
            return self._listener.accept(range(1, self.world), self.timeout_s, alive=self._check)
        finally:
            self._listener.close()

    def _check(self) -> None:
        """A rank whose actor failed before it connected: its error, now (not after the accept timeout)."""
        done, _ = self._ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        for ref in done:
            rank = self._runs.index(ref) + 1
            try:
                self._ray.get(ref)
            except Exception as e:  # noqa: BLE001 - reported with the rank
                raise RuntimeError(f"tensor-parallel rank {rank} (Ray actor) failed to start: {e}") from e
            raise RuntimeError(f"tensor-parallel rank {rank} (Ray actor) returned before connecting")

    def close(self) -> None:
        """After the quit message (the mp executor's shutdown sends it first): let the ranks return, then
        kill the actors and remove the placement group; a Ray instance this engine started is shut down."""
        ray = self._ray
        try:
            if self._listener is not None:
                self._listener.close()
            if self._runs:
                ray.wait(self._runs, num_returns=len(self._runs), timeout=10)
            for actor in self._actors:
                ray.kill(actor)
            if self._pg is not None:
                self._remove_pg(self._pg)
            if self._started:
                ray.shutdown()
        except Exception as e:  # noqa: BLE001 - at interpreter exit Ray may be gone already
            logger.debug("ray executor shutdown: %s", e)
        self._actors, self._runs, self._pg, self._started = [], [], None, False
        self.driver_init_method = None


def _connect(ray, config, world: int) -> bool:
    """Join the cluster; True when this call started a local one (then ours to shut down)."""
    if ray.is_initialized():
        return False
    if config.ray_address:
        ray.init(address=config.ray_address, logging_level=logging.WARNING)
        return False
    try:
        ray.init(address="auto", logging_level=logging.WARNING)
        return False
    except ConnectionError:
        pass
    ray.init(address="local", include_dashboard=False, num_cpus=max(os.cpu_count() or 1, world),
             logging_level=logging.WARNING)
    return True


def _node_ip(ray) -> str:
    """This node's address as the cluster knows it: where the rendezvous and the step connections listen."""
    me = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == me:
            return node["NodeManagerAddress"]
    raise RuntimeError("distributed_executor_backend: this process's Ray node is not in ray.nodes()")
