"""The Ray actor verl's replica launches per node, answering every call verl 0.9 makes on its rollout server
(the methods and semantics of its vLLM server, ``vLLMHttpServer``), over turnout's async engine.

- Generation: ``generate`` takes token ids and verl's sampling dict and returns verl's ``TokenOutput`` (the
  sampled tokens' logprobs, routed experts, stop reason, ``extra_fields`` with ``global_steps``).
- The submission gate: ``abort_all_requests`` closes it, waits for admissions already past it to reach the
  engine, then aborts everything in flight (partial tokens returned as "aborted"); it stays closed until
  ``resume_generation`` (or ``open_submission_gate``). Requests arriving meanwhile wait for it, or, after
  ``abort_all_requests(reject_request=True)``, come back at once as "aborted" so the client re-routes.
- Memory: sleep / wake_up by rollout mode, release / resume of the KV cache around a weight sync, as verl's.
- Weights: ``collective_rpc("update_weights_from_ipc", kwargs=...)`` receives verl's buckets on every engine
  rank (turnout/integrations/verl/buckets.py) with generation paused; the prefix cache is forgotten after.
- No HTTP endpoint: verl's agent loop reaches the server through Ray (``generate``); ``get_server_address``
  answers the node's address without a port.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import ray
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.replica import TokenOutput

from turnout.engine.async_engine import AsyncLLMEngine
from turnout.integrations.verl import buckets, sampling
from turnout.integrations.verl.config import engine_options

logger = logging.getLogger(__name__)

GATE_BARRIER_S = 60.0  # the longest an abort waits for admissions already past the gate (verl's too)
RPC_METHODS = ("update_weights_from_ipc",)


def _mode(rollout_mode) -> str:
    return getattr(rollout_mode, "value", rollout_mode)


class TurnoutServer:
    def __init__(self, config, model_config, rollout_mode, workers: list, replica_rank: int, node_rank: int,
                 gpus_per_node: int, nnodes: int, cuda_visible_devices: str, disaggregation_role: str = "null",
                 disaggregation_kv_transfer_config: dict | None = None):
        if disaggregation_role != "null":
            raise ValueError(f"disaggregation_role: prefill/decode disaggregation is not offered by turnout "
                             f"(got {disaggregation_role!r})")
        self.config = omega_conf_to_dataclass(config)
        self.model_config = model_config
        self.rollout_mode = _mode(rollout_mode)
        self.workers, self.replica_rank, self.node_rank = workers, replica_rank, node_rank
        self.gpus_per_node, self.nnodes, self.devices = gpus_per_node, nnodes, cuda_visible_devices
        self.global_steps = None  # the weights' version, set by the rollout after each update
        self._address = ray.util.get_node_ip_address().strip("[]")
        self._job_id = ray.get_runtime_context().get_job_id()
        self.engine: AsyncLLMEngine | None = None
        self._submission_paused = False
        self._rejecting = False
        self._admitting = 0
        self._resume_event = asyncio.Event()
        self._resume_event.set()
        self._running: dict[str, Any] = {}  # request id -> its latest output
        self._aborted: set[str] = set()  # ended by abort_request
        self._profile_said = False

    # ---- start-up ----------------------------------------------------------------------------------
    def get_master_address(self):
        """No data-parallel rendezvous (one engine per replica): nothing to hand the other nodes."""
        return None, None, None

    def get_server_address(self):
        """The node's address; the port is None (no HTTP endpoint: generation goes through Ray)."""
        return self._address, None

    def get_rollout_config(self):
        return self.config

    async def launch_server(self, master_address: str = None, master_port: int = None, dp_rpc_port: int = None):
        from turnout.engine.llm import LLM

        opts = engine_options(self.config, self.replica_rank, self.devices)
        llm = await asyncio.to_thread(LLM, self.model_config.local_path, **opts)
        self.max_model_len = int(llm.engine.max_model_len)
        self.engine = AsyncLLMEngine(llm.engine, max_num_seqs=llm.engine.config.max_num_seqs or 256,
                                     log_stats_interval_s=None).start()

    # ---- generation --------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: list[Any] | None = None, video_data: list[Any] | None = None,
                       audio_data: list[Any] | None = None, mm_processor_kwargs: dict[str, Any] | None = None,
                       priority: int = 0, kv_transfer_params: dict | None = None) -> TokenOutput:
        for name, v in (("image_data", image_data), ("video_data", video_data), ("audio_data", audio_data),
                        ("mm_processor_kwargs", mm_processor_kwargs), ("kv_transfer_params", kv_transfer_params)):
            if v:
                raise ValueError(f"{name}: the turnout rollout is text-only and not disaggregated")
        if priority != 0:
            raise ValueError(f"priority: request priorities are not supported by turnout (got {priority!r})")
        try:  # verl hands a list, a numpy array or a tensor of token ids
            prompt_ids = [int(t) for t in getattr(prompt_ids, "tolist", lambda: prompt_ids)()]
        except (TypeError, ValueError):
            raise ValueError(f"prompt_ids: a list of token ids, got {type(prompt_ids).__name__}") from None
        cfg = self.config
        params = sampling.sampling_params(
            sampling_params, len(prompt_ids), max_model_len=self.max_model_len, prompt_length=cfg.prompt_length,
            response_length=cfg.response_length, routed_experts=cfg.enable_rollout_routing_replay,
            defaults={"repetition_penalty": cfg.get("repetition_penalty", 1.0), "ignore_eos": cfg.get("ignore_eos", False),
                      **({"seed": self.replica_rank + cfg.seed} if cfg.get("full_determinism", False) else {})})
        while self._submission_paused:  # the gate: closed by abort_all_requests until resume_generation
            if self._rejecting:
                return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps})
            await self._resume_event.wait()
        self._admitting += 1  # no await since the check: an abort sees it or sees the request in the engine
        try:
            stream = await self.engine.add_request(request_id, prompt_ids, params)
        finally:
            self._admitting -= 1
        last = None
        try:
            async for out in stream:
                last = self._running[request_id] = out
        finally:
            self._running.pop(request_id, None)
            aborted = request_id in self._aborted
            self._aborted.discard(request_id)
        if last is None:
            return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps})
        fields = sampling.token_output_fields(last, params, self.global_steps)
        if aborted or not last.finished:
            fields["stop_reason"] = "aborted"
        return TokenOutput(**fields)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Close the gate, let admissions past it land, abort everything in flight. The gate stays closed
        until ``resume_generation``; ``reject_request``: requests meanwhile return "aborted" at once."""
        if self.node_rank != 0:
            return {"aborted_count": 0, "request_ids": []}
        self._submission_paused, self._rejecting = True, reject_request
        self._resume_event.clear()
        deadline = time.monotonic() + GATE_BARRIER_S
        while self._admitting > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._admitting:
            logger.warning("abort: %d admission(s) still in flight after %.0fs", self._admitting, GATE_BARRIER_S)
        outs = await self.engine.pause_generation("abort")
        if reset_prefix_cache:
            await self.engine.reset_prefix_cache()
        ids = [o.request_id for o in outs]
        return {"aborted_count": len(ids), "request_ids": ids}

    async def resume_engine_generation(self):
        if self.node_rank == 0 and self.engine.is_paused():
            await self.engine.resume_generation()

    async def open_submission_gate(self):
        self._rejecting = self._submission_paused = False
        self._resume_event.set()

    async def resume_generation(self):
        await self.resume_engine_generation()
        await self.open_submission_gate()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        if self.node_rank != 0:
            return {"aborted": False, "request_id": request_id}
        if request_id not in self._running:
            return {"aborted": False, "error": f"Request {request_id} not found"}
        self._aborted.add(request_id)
        self.engine.abort(request_id)
        if reset_prefix_cache:
            await self.clear_kv_cache()
        return {"aborted": True, "request_id": request_id}

    async def wait_for_requests_to_drain(self):
        while self.engine.num_in_flight or self._admitting:
            await asyncio.sleep(0.02)

    # ---- memory ------------------------------------------------------------------------------------
    def _sleep_level(self) -> int:
        """verl's choice: level 2 (weights dropped, the trainer pushes them again) unless a LoRA adapter or
        an MTP drafter needs the weights kept."""
        lora = self.model_config.lora_rank > 0 or self.model_config.lora.get("rank", 0) > 0
        mtp = self.config.mtp is not None and self.config.mtp.enable and self.config.mtp.enable_rollout
        return 1 if (lora and not self.model_config.lora.get("merge", False)) or mtp else 2

    async def wake_up(self, tags: list[str] | None = None):
        if self.node_rank != 0 or self.rollout_mode == "standalone":
            return
        tags = tags if (tags and self.rollout_mode == "hybrid") else ["kv_cache", "weights"]
        await self.engine.wake_up([t for t in ("weights", "kv_cache") if t in tags])
        await self.engine.reset_prefix_cache()

    async def sleep(self):
        if self.node_rank != 0 or not self.config.free_cache_engine or self.rollout_mode == "standalone":
            return
        await self.engine.sleep(self._sleep_level() if self.rollout_mode == "hybrid" else 1)

    async def clear_kv_cache(self):
        if self.node_rank == 0:
            await self.engine.reset_prefix_cache()

    async def release_kv_cache(self):
        """The KV cache's memory freed for a weight sync, the weights left in place to be written."""
        if self.node_rank != 0 or not self.config.free_cache_engine or self.rollout_mode == "colocated":
            return
        await self.engine.sleep(self._sleep_level())
        await self.engine.wake_up(["weights"])

    async def resume_kv_cache(self):
        if self.node_rank != 0 or not self.config.free_cache_engine or self.rollout_mode == "colocated":
            return
        await self.engine.wake_up(["kv_cache"])
        await self.engine.reset_prefix_cache()

    async def start_profile(self, **kwargs):
        if not self._profile_said:
            logger.info("start_profile / stop_profile: no-ops in the turnout rollout (profile the engine with "
                        "torch.profiler or `turnout bench` instead)")
            self._profile_said = True

    async def stop_profile(self):
        await self.start_profile()

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def set_pd_peer(self, decode_peers: list, prefill_side_channel_port: int, prefill_engine_id: str) -> None:
        raise NotImplementedError("set_pd_peer: prefill/decode disaggregation is not offered by turnout")

    # ---- weights -----------------------------------------------------------------------------------
    async def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None):
        """``"update_weights_from_ipc"`` (verl's bucket transport: ``peft_config``, ``base_sync_done``,
        ``use_shm``), or a callable taking turnout's worker first, run on every engine rank."""
        kwargs = dict(kwargs or {})
        if callable(method):
            call = self.engine.collective_rpc(method, tuple(args), kwargs)
        elif method == "update_weights_from_ipc":
            if kwargs.pop("peft_config", None):
                raise ValueError("peft_config: LoRA adapters are not served by turnout; set "
                                 "actor_rollout_ref.model.lora.merge=True so verl pushes merged weights")
            kwargs.pop("base_sync_done", None)
            use_shm = bool(kwargs.pop("use_shm", False))
            if kwargs or args:
                raise ValueError(f"update_weights_from_ipc: unexpected arguments {sorted(kwargs) or list(args)}")
            handles = [buckets.zmq_handle(self._job_id, self.replica_rank, r) for r in range(self.engine.world_size)]
            call = self.engine.collective_rpc(buckets.receive_buckets_rank, (handles, use_shm), writes_weights=True)
        else:
            raise ValueError(f"method: {method!r} is not one turnout's rollout runs; known: {list(RPC_METHODS)} "
                             "or a callable taking the worker")
        return await (asyncio.wait_for(call, timeout) if timeout else call)
