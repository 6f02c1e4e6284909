"""Data parallelism: N engine replicas behind one server (``--data-parallel-size N``).

``DataParallelEngine`` starts the replicas (turnout/engine/dp_replica.py: a process each, with its own
executor, so a replica may itself be tensor-parallel) and holds what the server needs once: the tokenizer,
the context limit, the model's name, the op table. ``DPAsyncEngine`` has ``AsyncLLMEngine``'s interface and
wraps one ``AsyncLLMEngine`` per replica, each stepping its replica from a thread of its own.

Routing (``Router.pick``): a request goes to the replica with the least load (requests in flight there:
running + waiting + admitted-not-yet-stepped), except that a prompt whose first block of tokens was routed
before goes back to the same replica while that replica's load is within ``PREFIX_SLACK`` of the least, so
that shared prefixes (a system prompt, a conversation's earlier turns) hit that replica's prefix cache. The
``n`` samples of one request share a replica (they share the prompt's blocks).

Faults: a replica that dies kills the whole server loudly (every replica's requests fail, /health 503, the
process exits 1 after --dead-engine-grace), as one engine's death does; a supervisor restarts it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import weakref
from collections import OrderedDict

from turnout.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineDraining
from turnout.engine.core_outputs import EngineStats

logger = logging.getLogger(__name__)

PREFIX_SLACK = 2  # requests a prefix's replica may be loaded above the least loaded one and still get it
_PREFIX_TOKENS = 32  # the prompt head a prefix is known by (two 16-token blocks)
_PREFIX_CHARS = 128  # the same for a text prompt
_PREFIX_MEMORY = 4096  # prefixes remembered (least recently routed forgotten first)


class DataParallelEngine:
    """The replicas of one model, each ``dataclasses.replace(config, data_parallel_rank=r)``."""

    def __init__(self, config):
        import multiprocessing as mp

        from turnout.engine.dp_replica import ReplicaClient
        from turnout.engine.input_processor import InputProcessor
        from turnout.ops import Policy, resolve
        from turnout.platforms import detect_platform

        self.config = config
        ctx = mp.get_context("spawn")
        self.replicas = [ReplicaClient(dataclasses.replace(config, data_parallel_rank=r), r, ctx)
                         for r in range(config.data_parallel_size)]
        self._finalizer = weakref.finalize(self, _shutdown_all, list(self.replicas))
        try:
            infos = [r.wait_ready() for r in self.replicas]  # they load in parallel
        except BaseException:
            self.shutdown()
            raise
        info = infos[0]
        self.tokenizer = info["tokenizer"]
        self.max_model_len = info["max_model_len"]
        self.model_name = info["model_name"]
        self.vocab_size = info["vocab_size"]
        self.eos_ids = set(info["eos_ids"])
        self.platform = detect_platform(config.device)
        self.ops = resolve(self.platform, Policy.for_config(config, platform=self.platform))  # what each resolved
        # chat templates and tokenising for the server, here (the replicas admit what it sends)
        self._inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len,
                                      config.max_tokens_per_request, config.seed, stop_token_ids=sorted(self.eos_ids))
        logger.info("data parallel: %d replicas (pids %s), %d rank(s) each", len(self.replicas),
                    [i["pid"] for i in infos], config.tensor_parallel_size)

    def encode(self, prompt: str) -> list[int]:
        return self._inputs.encode(prompt)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        return self._inputs.apply_chat_template(messages, add_generation_prompt, **template_kwargs)

    def shutdown(self) -> None:
        self._finalizer()


def _shutdown_all(replicas) -> None:
    for r in replicas:
        r.shutdown()


class Router:
    """Least load, prefix-sticky within ``PREFIX_SLACK`` (see the module's docstring)."""

    def __init__(self, n: int):
        self.n = n
        self._prefix: OrderedDict[bytes, int] = OrderedDict()

    @staticmethod
    def prefix_key(prompt) -> bytes | None:
        if isinstance(prompt, str):
            return hashlib.blake2b(prompt[:_PREFIX_CHARS].encode(), digest_size=16).digest() \
                if len(prompt) >= _PREFIX_CHARS else None
        if len(prompt) < _PREFIX_TOKENS:
            return None
        return hashlib.blake2b(repr(list(prompt[:_PREFIX_TOKENS])).encode(), digest_size=16).digest()

    def pick(self, loads: list[int], prompt) -> int:
        least = min(range(self.n), key=lambda i: (loads[i], i))
        key = self.prefix_key(prompt)
        if key is None:
            return least
        chosen = self._prefix.get(key)
        if chosen is None or loads[chosen] > loads[least] + PREFIX_SLACK:
            chosen = least
        self._prefix[key] = chosen
        self._prefix.move_to_end(key)
        if len(self._prefix) > _PREFIX_MEMORY:
            self._prefix.popitem(last=False)
        return chosen


class DPAsyncEngine:
    """``AsyncLLMEngine``'s interface over one ``AsyncLLMEngine`` per replica (see the module docstring)."""

    def __init__(self, engine: DataParallelEngine, *, max_queue: int = 1024, max_num_seqs: int = 256,
                 observer=None, on_dead=None):
        n = len(engine.replicas)
        self.engine = engine
        self.on_dead = on_dead
        # each replica queues its share: the server-wide --max-queue split among them
        self.replicas = [AsyncLLMEngine(r, max_queue=max(1, -(-max_queue // n)), max_num_seqs=max_num_seqs,
                                        observer=observer, on_dead=self._replica_died) for r in engine.replicas]
        self.router = Router(n)
        self.admitted = [0] * n  # requests each replica was given (the per-replica metric)
        self.dead: BaseException | None = None
        self.draining = False
        self.unavailable = None

    def start(self) -> "DPAsyncEngine":
        for r in self.replicas:
            r.start()
        return self

    # ---- lifecycle -----------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.dead is None and all(r.is_running for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def stats(self) -> EngineStats:
        return sum_stats([r.stats for r in self.replicas])

    def start_draining(self) -> None:
        self.draining = True
        for r in self.replicas:
            r.start_draining()

    async def wait_idle(self, timeout: float) -> bool:
        import asyncio

        results = await asyncio.gather(*(r.wait_idle(timeout) for r in self.replicas))
        return all(results)

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        import asyncio

        self.start_draining()
        await asyncio.gather(*(r.shutdown(drain_timeout) for r in self.replicas))
        await asyncio.to_thread(self.engine.shutdown)

    def _replica_died(self, exc: BaseException) -> None:
        """On the event loop: one replica's thread died. The server dies with it: fail the other replicas'
        requests now, then tell the server once."""
        if self.dead is not None:
            return
        self.dead = exc
        err = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
        for r in self.replicas:
            if r.dead is None:
                r.dead = exc  # refuses new requests
                with r._lock:
                    rids = list(r._tracked)
                for rid in rids:
                    r.abort(rid, error=err)
        if self.on_dead is not None:
            self.on_dead(exc)

    # ---- requests ------------------------------------------------------------------------------
    async def add_requests(self, items):
        if self.dead is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead}")
        if self.draining:
            raise EngineDraining("the server is shutting down")
        for rid, _, _ in items:
            if any(rid in r._tracked for r in self.replicas):
                raise ValueError(f"request_id: {rid!r} is already in flight")
        i = self.router.pick([r.num_in_flight for r in self.replicas], items[0][1])
        streams = await self.replicas[i].add_requests(items)
        self.admitted[i] += len(items)
        return streams

    async def add_request(self, request_id, prompt, params):
        return (await self.add_requests([(request_id, prompt, params)]))[0]

    async def generate(self, request_id, prompt, params):
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            self.abort(request_id)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        for r in self.replicas:  # a no-op where it does not run
            r.abort(request_id, error)

    # ---- the RL control plane is per engine: not offered across replicas ----------------------
    def __getattr__(self, name):
        if name in ("pause_generation", "resume_generation", "sleep", "wake_up", "update_weights",
                    "update_weights_from_disk", "init_weight_update_group", "update_weights_from_distributed",
                    "reset_prefix_cache", "is_paused", "is_sleeping"):
            raise AttributeError(f"{name}: the RL control plane is not available with data_parallel_size > 1")
        raise AttributeError(name)


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """The replicas' counters and gauges summed (per-position counters position by position); KV-cache usage
    averaged (each replica has its own cache)."""
    total = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if f.name == "kv_cache_usage":
            total[f.name] = sum(values) / len(values)
        elif values and isinstance(values[0], list):  # replicas may have seen drafts at different depths
            total[f.name] = [sum(v[j] for v in values if j < len(v)) for j in range(max(map(len, values)))]
        else:
            total[f.name] = sum(values)
    return EngineStats(**total)
