"""turnout as verl's rollout engine: the method names and shapes of verl's vLLM rollout server
(``vLLMHttpServer`` in verl/workers/rollout/vllm_rollout/vllm_async_server.py) and of its trainer-side
``BaseRollout`` (``resume`` / ``release`` / ``update_weights``), over turnout's async engine.

- ``TurnoutRolloutServer(engine)``: what verl's agent loop and ``RolloutReplica`` call on a rollout
  server: ``generate(prompt_ids, sampling_params, request_id)`` -> ``TokenOutput`` (token ids, the log
  probability of each, routed experts, stop reason "completed" | "aborted"), ``wake_up``, ``sleep``,
  ``clear_kv_cache``, ``abort_all_requests``, ``abort_request``, and the weight updates.
- ``TurnoutRolloutAdapter(server)``: the ``BaseRollout`` side (``resume(tags)``, ``release()``,
  ``update_weights(weights)``) that verl's hybrid worker calls around each training step.

verl's own server reaches vLLM through Ray actors, ZMQ and CUDA-IPC buckets because vLLM runs in other
processes; here the engine is in the caller's process (its TP ranks are the executor's business), so a
weight update is the (name, tensor) iterator handed to ``update_weights`` directly. Every coroutine is a
command on the engine thread between two steps (turnout/engine/async_rl.py), so calls from the event
loop never race a step. Nothing from verl is imported here; ``TokenOutput.to_verl()`` builds verl's own
class when verl is installed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from turnout.engine.async_engine import AsyncLLMEngine
from turnout.engine.rl import TokenOutput as _EngineTokenOutput
from turnout.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# SamplingParams' own fields, and the SGLang spelling verl also sends
_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.init)
_MAX_TOKENS_ALIASES = ("max_tokens", "max_new_tokens")


@dataclasses.dataclass
class TokenOutput:
    """verl's ``TokenOutput`` (verl/workers/rollout/replica.py), field for field."""

    token_ids: list[int]
    log_probs: list[float] | None = None  # of each generated token, when sampling_params asked for logprobs
    routed_experts: Any = None  # int32 [prompt + generated - 1, moe layers, top_k] with routing replay on
    stop_reason: str | None = None  # "completed" | "aborted"
    num_preempted: int | None = None  # not counted per request by turnout: None, as verl reads "unknown"

    def to_verl(self):
        """The same values as verl's own pydantic ``TokenOutput`` (needs verl installed)."""
        from verl.workers.rollout.replica import TokenOutput as VerlTokenOutput

        return VerlTokenOutput(**dataclasses.asdict(self))


class TurnoutRolloutServer:
    """A rollout server shaped like verl's ``vLLMHttpServer``, over one turnout engine.

    ``engine``: an ``LLM``, an ``LLMEngine`` or an ``AsyncLLMEngine``. The async engine's thread is started
    on the first call, in the running event loop, and stopped by ``shutdown()`` (a later call starts a new
    one in the loop running then). While the server runs, do not step the same engine through ``LLM``.
    ``response_length``: the default ``max_tokens`` when ``sampling_params`` gives none (verl's
    ``config.response_length``); without it, up to the context limit. ``enable_rollout_routing_replay``:
    every request returns its routed experts (MoE models).
    """

    def __init__(self, engine, *, response_length: int | None = None, enable_rollout_routing_replay: bool = False):
        if isinstance(engine, AsyncLLMEngine):
            self._async, self.engine = engine, engine.engine
        else:
            self._async, self.engine = None, getattr(engine, "engine", engine)  # an LLM holds its LLMEngine
        if not hasattr(self.engine, "rl"):
            raise ValueError(f"engine: expected an LLM, LLMEngine or AsyncLLMEngine, got {type(engine).__name__}")
        if response_length is not None and (type(response_length) is not int or response_length < 1):
            raise ValueError(f"response_length: must be a positive integer, got {response_length!r}")
        self.response_length = response_length
        self.enable_rollout_routing_replay = bool(enable_rollout_routing_replay)
        self.max_model_len = int(self.engine.max_model_len)
        self._last: dict[str, Any] = {}  # request id -> its latest output, while it runs
        self._aborted: set[str] = set()  # ended by abort_request: their generate returns "aborted"

    # ---- the engine thread ----------------------------------------------------------------------
    def _engine(self) -> AsyncLLMEngine:
        loop = asyncio.get_running_loop()
        if self._async is None or not self._async.is_running or self._async._loop is not loop:
            if self._async is not None and self._async.is_running:
                raise RuntimeError("the rollout server's engine runs in another event loop; call shutdown() there")
            seqs = getattr(getattr(self.engine, "config", None), "max_num_seqs", None) or 256  # its admission bound
            self._async = AsyncLLMEngine(self.engine, max_num_seqs=seqs).start()
        return self._async

    async def shutdown(self) -> None:
        """Stop the engine thread (running requests finish first); the engine itself stays loaded."""
        if self._async is not None and self._async.is_running:
            await self._async.shutdown(drain_timeout=30.0)
        self._async = None

    # ---- generation -----------------------------------------------------------------------------
    def sampling_params(self, sampling_params: dict, num_prompt_tokens: int) -> SamplingParams:
        """verl's sampling dict -> SamplingParams. As verl's vLLM server: ``max_tokens`` (or SGLang's
        ``max_new_tokens``; default ``response_length``, else the room left) clamped to the context left,
        ``logprobs`` True -> the sampled token's logprob. Any other key must be a SamplingParams field:
        an unknown one is a ValueError naming it (never silently dropped). No room left at all (verl
        clamps max_tokens to 0): ``max_tokens == 0`` on a params object that is never admitted."""
        if not isinstance(sampling_params, dict):
            raise ValueError(f"sampling_params: must be a dict, got {type(sampling_params).__name__}")
        sp = dict(sampling_params)
        room = self.max_model_len - num_prompt_tokens
        if room < 0:
            raise ValueError(f"prompt_ids: {num_prompt_tokens} tokens exceed the context length {self.max_model_len}")
        given = [k for k in _MAX_TOKENS_ALIASES if k in sp]
        if len(given) > 1:
            raise ValueError("sampling_params: give max_tokens or max_new_tokens, not both")
        max_tokens = sp.pop(given[0]) if given else (self.response_length or room)
        if type(max_tokens) is not int:
            raise ValueError(f"sampling_params.{given[0]}: must be an integer, got {max_tokens!r}")
        max_tokens = max(0, min(max_tokens, room))
        lp = sp.pop("logprobs", None)
        sp["logprobs"] = 0 if lp is True else (None if lp is False else lp)
        sp.setdefault("return_routed_experts", self.enable_rollout_routing_replay)
        unknown = sorted(set(sp) - _PARAM_FIELDS)
        if unknown:
            raise ValueError(f"sampling_params.{unknown[0]}: not a sampling parameter turnout knows")
        if sp.get("n", 1) != 1:
            raise ValueError(f"sampling_params.n: generate returns one sample (got {sp['n']}); repeat the request")
        params = SamplingParams(**sp, max_tokens=max(max_tokens, 1))  # every value checked, naming its field
        params.max_tokens = max_tokens  # 0: generate answers without admitting it
        return params

    async def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str,
                       image_data: list | None = None, video_data: list | None = None, priority: int = 0) -> TokenOutput:
        """Token ids in, ``TokenOutput`` out (one sample). An abort (``abort_all_requests``,
        ``abort_request``) returns the tokens generated so far with ``stop_reason == "aborted"``."""
        if image_data is not None or video_data is not None:
            raise ValueError(f"{'image_data' if image_data is not None else 'video_data'}: this engine is "
                             "text-only")
        if priority != 0:
            raise ValueError(f"priority: request priorities are not supported (got {priority!r})")
        if not isinstance(prompt_ids, (list, tuple)) or not all(type(t) is int for t in prompt_ids):
            raise ValueError("prompt_ids: must be a list of token ids")
        params = self.sampling_params(sampling_params, len(prompt_ids))
        if params.max_tokens == 0:  # no room left to generate
            return TokenOutput([], [] if params.logprobs is not None else None, None, "completed")
        stream = await self._engine().add_request(request_id, list(prompt_ids), params)
        last = None
        try:
            async for out in stream:
                last = self._last[request_id] = out
        finally:
            self._last.pop(request_id, None)
            aborted = request_id in self._aborted
            self._aborted.discard(request_id)
        if last is None or (not last.finished and not aborted):
            raise RuntimeError(f"request {request_id!r} ended without an output")
        tok = _EngineTokenOutput.from_request_output(last)
        if tok.stop_reason == "error":
            raise RuntimeError(f"request {request_id!r} failed inside the engine: {tok.error}")
        comp = last.outputs[0]
        log_probs = None
        if params.logprobs is not None:
            log_probs = [e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs or [])]
        return TokenOutput(token_ids=list(comp.token_ids), log_probs=log_probs, routed_experts=tok.routed_experts,
                           stop_reason="aborted" if aborted or not last.finished else tok.stop_reason)

    async def abort_all_requests(self, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Every running request ends now with its partial output (its ``generate`` returns
        ``stop_reason "aborted"``); new requests are admitted again right after, as in verl's server.
        Returns ``{"aborted_count", "request_ids"}``."""
        ae = self._engine()
        outs = await ae.pause_generation("abort")
        await ae.resume_generation()
        if reset_prefix_cache:
            await self.clear_kv_cache()
        ids = [o.request_id for o in outs]
        return {"aborted_count": len(ids), "request_ids": ids}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """One request ends now; its ``generate`` returns what it had with ``stop_reason "aborted"``."""
        if request_id not in self._last:
            return {"aborted": False, "request_id": request_id, "error": f"Request {request_id} not found"}
        self._aborted.add(request_id)
        self._engine().abort(request_id)
        if reset_prefix_cache:
            await self.clear_kv_cache()
        return {"aborted": True, "request_id": request_id}

    async def pause_generation(self, mode: str = "abort") -> list:
        """turnout's pause: "abort" as ``abort_all_requests`` but admission stays closed, "keep" freezes
        running requests; both until ``resume_generation()`` (partial rollout across a weight update)."""
        return await self._engine().pause_generation(mode)

    async def resume_generation(self) -> None:
        await self._engine().resume_generation()

    # ---- memory and weights ---------------------------------------------------------------------
    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Weights and / or KV cache back on the device (default both); the prefix cache starts empty."""
        await self._engine().wake_up(tags)

    async def sleep(self, level: int = 1) -> None:
        """Level 1: weights to host memory, KV cache freed; level 2: both freed (push weights after
        wake_up). Needs no request in flight: ``abort_all_requests`` first."""
        await self._engine().sleep(level)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    async def clear_kv_cache(self) -> None:
        await self._engine().reset_prefix_cache()

    async def update_weights(self, weights, **kwargs) -> list[str]:
        """(HF checkpoint name, full tensor) pairs, a sync or async iterator (verl's trainer yields them),
        or a dict; any subset. All or nothing (a bad tensor is a ValueError naming it, nothing written);
        generation is paused around the write and the prefix cache is forgotten. Returns the names written."""
        if kwargs.get("peft_config") is not None:
            raise ValueError("peft_config: LoRA adapters are not supported; push merged weights")
        unknown = sorted(set(kwargs) - {"peft_config", "base_sync_done"})
        if unknown:
            raise ValueError(f"{unknown[0]}: not an update_weights option turnout knows")
        if hasattr(weights, "__aiter__"):
            weights = [item async for item in weights]
        return await self._engine().update_weights(weights)

    async def update_weights_from_disk(self, path: str) -> list[str]:
        return await self._engine().update_weights_from_disk(path)


class TurnoutRolloutAdapter:
    """verl's ``BaseRollout`` methods (what its hybrid worker calls between training and rollout) over a
    ``TurnoutRolloutServer``: ``resume(tags)`` = wake_up, ``release()`` = sleep(``sleep_level``),
    ``update_weights(weights)``. ``generate_sequences`` is not offered, as in verl's server mode."""

    def __init__(self, server: TurnoutRolloutServer, sleep_level: int = 1):
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level: must be 1 or 2, got {sleep_level!r}")
        self.server, self.sleep_level = server, sleep_level

    async def resume(self, tags: list[str]) -> None:
        await self.server.wake_up(tags)

    async def release(self) -> None:
        await self.server.sleep(self.sleep_level)

    async def update_weights(self, weights, **kwargs) -> None:
        await self.server.update_weights(weights, **kwargs)

    def generate_sequences(self, prompts):
        raise NotImplementedError("server mode: call TurnoutRolloutServer.generate per request")
