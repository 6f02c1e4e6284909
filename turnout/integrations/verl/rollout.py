"""verl's two rollout classes for turnout: ``TurnoutRollout`` (a ``BaseRollout``: what verl's trainer-side
workers call around a training step) and ``TurnoutReplica`` (a ``RolloutReplica``: launches one
``TurnoutServer`` Ray actor per node of the replica, named as verl's other backends name theirs, so that
the trainer-side rollout finds it with ``ray.get_actor``). Imported only through verl's registries
(turnout/integrations/verl/__init__.py), i.e. where verl is installed."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica

from turnout.integrations.verl.buckets import BucketSender, zmq_handle
from turnout.integrations.verl.config import check_supported
from turnout.integrations.verl.server import TurnoutServer

logger = logging.getLogger(__name__)

NAME = "turnout"


def _server_name(replica_rank: int, node_rank: int, kind: str = "", suffix: str = "") -> str:
    return f"{NAME}_server_{kind}{replica_rank}_{node_rank}{suffix}"


def _use_shm() -> bool:
    """CUDA IPC where there is a GPU whose platform verl says shares memory by IPC; a shared-memory segment
    otherwise (the host, NPUs without IPC). verl's own rule alone answers for a GPU it guessed on a CPU-only
    host."""
    import torch

    if not torch.cuda.is_available():
        return True
    try:
        from verl.utils.device import is_support_ipc
    except ImportError:  # a verl without the helper: CUDA shares by IPC
        return False
    return not is_support_ipc()


class TurnoutRollout(BaseRollout):
    """Runs in each trainer-side worker of the replica (rank ``RANK`` of the trainer's world). The worker
    whose rollout rank is 0 drives the server; every worker sends its weights to the engine rank of its
    local rank, over verl's bucket transport."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        check_supported(self.config)
        from turnout import envs

        env = envs.get()  # verl's worker group sets both; absent: a single worker
        rank = env.rank or 0
        local_world = env.ray_local_world_size or 1
        world = self.config.tensor_model_parallel_size
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.node_rank = self.rollout_rank // local_world
        self.is_leader_rank = self.rollout_rank == 0
        self.sleep_level = 2
        self.server_handle = None
        self.use_shm = _use_shm()
        self.zmq_handle = zmq_handle(ray.get_runtime_context().get_job_id(), self.replica_rank,
                                     self.rollout_rank % local_world)

    def _server(self):
        if self.server_handle is None:
            self.server_handle = ray.get_actor(_server_name(self.replica_rank, self.node_rank))
        return self.server_handle

    async def resume(self, tags: list[str]):
        if self.config.free_cache_engine and self.is_leader_rank:
            await self._server().wake_up.remote(tags=tags)

    async def release(self):
        if self.config.free_cache_engine and self.is_leader_rank:
            await self._server().sleep.remote()

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps: int = None,
                             peft_config: dict = None, base_sync_done: bool = True, **kwargs):
        """(HF name, full tensor) pairs, a sync or async iterator, into the engine: the leader asks the server
        to receive on every engine rank, every trainer worker sends its bucket stream; then the prefix cache
        is forgotten and the weights' version (``global_steps``) set, as verl's vLLM rollout does."""
        if wire_format != "named_tensors":
            raise ValueError(f"wire_format: turnout receives full tensors ('named_tensors'); got {wire_format!r} "
                             "(delta_flush carries vLLM's weight patches)")
        if peft_config:
            raise ValueError("peft_config: LoRA adapters are not served by turnout; set "
                             "actor_rollout_ref.model.lora.merge=True so verl pushes merged weights")
        if kwargs:
            raise ValueError(f"{sorted(kwargs)[0]}: not an update_weights option of verl 0.9 turnout knows")
        receive = None
        if self.is_leader_rank:
            receive = self._server().collective_rpc.remote(
                "update_weights_from_ipc", kwargs={"peft_config": None, "base_sync_done": base_sync_done,
                                                   "use_shm": self.use_shm})
        bucket = self.config.checkpoint_engine.update_weights_bucket_megabytes << 20
        send = asyncio.ensure_future(BucketSender(self.zmq_handle, bucket, self.use_shm).send(weights))
        if receive is not None:
            receive = asyncio.ensure_future(_await_ref(receive))
            await asyncio.wait({send, receive}, return_when=asyncio.FIRST_EXCEPTION)
            if receive.done() and receive.exception() is not None:
                send.cancel()  # the engine refused: nobody will answer the sender
                raise receive.exception()
            if send.done() and send.exception() is not None:
                await asyncio.gather(receive, return_exceptions=True)  # told of the failure, it stops
                raise send.exception()
            await receive
        await send
        if self.is_leader_rank:
            await self._server().clear_kv_cache.remote()
            if global_steps is not None:
                await self._server().set_global_steps.remote(global_steps)

    def generate_sequences(self, prompts):
        raise NotImplementedError("the turnout rollout is server mode only: verl's agent loop generates through "
                                  "TurnoutReplica's servers")


async def _await_ref(ref):
    return await ref


class TurnoutReplica(RolloutReplica):
    def __init__(self, replica_rank: int, config, model_config, gpus_per_node: int = 8, is_reward_model: bool = False,
                 is_teacher_model: bool = False, name_suffix: str = ""):
        super().__init__(replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model,
                         name_suffix)
        check_supported(self.config)
        if self.nnodes != 1:
            raise ValueError(f"rollout.tensor_model_parallel_size: a turnout replica runs on one node (its "
                             f"{self.world_size} ranks span {self.nnodes} nodes of {gpus_per_node})")
        self.server_class = ray.remote(TurnoutServer)

    def rollout_worker_use_gpu(self) -> bool:
        from verl.utils.device import is_cuda_available, is_npu_available

        return bool(is_cuda_available or is_npu_available)

    def _kind(self) -> str:
        return "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""

    async def launch_servers(self):
        if len(self.workers) != self.world_size:
            raise ValueError(f"workers: {len(self.workers)} for a replica of {self.world_size} ranks")

        def where(_self):
            ctx = ray.get_runtime_context()
            ids = [i for v in ctx.get_accelerator_ids().values() for i in v]  # none on a CPU-only node
            return ctx.get_node_id(), ids[0] if ids else None

        infos = await asyncio.gather(*[w.__ray_call__.remote(where) for w in self.workers])
        devices = ",".join(str(d) for _, d in infos if d is not None)
        from verl.plugin.platform import get_platform

        env = {**{v: "1" for v in get_platform().ray_noset_envvars()}, **get_platform().rollout_env_vars()}
        if devices:
            from verl.utils.device import get_visible_devices_keyword

            env[get_visible_devices_keyword()] = devices
        server = self.server_class.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=infos[0][0],
                                                                                              soft=False),
            runtime_env={"env_vars": env}, name=_server_name(self.replica_rank, 0, self._kind(), self.name_suffix),
            max_concurrency=self.max_concurrency,
        ).remote(config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
                 workers=self.workers, replica_rank=self.replica_rank, node_rank=0,
                 gpus_per_node=self.gpus_per_replica_node, nnodes=1, cuda_visible_devices=devices)
        self.servers = [server]
        await server.launch_server.remote()
        address, _ = await server.get_server_address.remote()
        self._server_handle = server
        # the load balancer keys its servers by this: unique per replica, though no HTTP port is served
        self._server_address = f"{address}/{_server_name(self.replica_rank, 0, self._kind(), self.name_suffix)}"

    async def sleep(self):
        await self.servers[0].wait_for_requests_to_drain.remote()
        await asyncio.gather(*[s.sleep.remote() for s in self.servers])

    async def release_kv_cache(self):
        await self.servers[0].wait_for_requests_to_drain.remote()
        await asyncio.gather(*[s.release_kv_cache.remote() for s in self.servers])

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        results = await asyncio.gather(*[s.abort_all_requests.remote(reject_request=reject_request)
                                         for s in self.servers])
        return {"aborted_count": sum(r["aborted_count"] for r in results),
                "request_ids": [i for r in results for i in r["request_ids"]], "server_results": results}

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        for r in await asyncio.gather(*[s.abort_request.remote(request_id) for s in self.servers]):
            if r.get("aborted"):
                return r
        return {"aborted": False, "request_id": request_id, "error": "Request not found on any server"}
