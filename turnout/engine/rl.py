"""The engine's side of the RL control plane (docs/architecture.md, "RL rollout"): sleep / wake, weight
updates, pause / abort / resume, prefix-cache resets, and the token-in / token-out output an RL loop reads.

The work on tensors happens on every rank (turnout/worker/rank_memory.py), reached through the executor's
``collective_rpc``; what is decided here is what the scheduler may do meanwhile.

- Sleeping needs an idle engine (no unfinished request): the KV cache goes, so nothing may hold blocks. While
  any part sleeps, admitting a request is a RuntimeError naming the state.
- A weight update (and ``clear_kv_cache``) makes every cached prefix unreachable, in use or not (the KV
  was computed with the old weights; ``BlockManager.forget_prefix_cache``). Waking the KV cache resets it.
- ``pause_generation("abort")`` (and ``abort_all_requests``) ends every unfinished request now, its output
  carrying its partial tokens and logprobs with ``finish_reason == "abort"``; ``"keep"`` leaves them where
  they are, not stepped, to continue after ``resume_generation`` (with whatever weights are there by then).
  Either way no request is admitted until ``resume_generation``: a rollout loop that keeps submitting cannot
  start new work on the old weights between the abort and the trainer's push.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass, field

from turnout.engine.outputs import RequestOutput
from turnout.worker import rank_memory

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "keep")


@dataclass
class TokenOutput:
    """A token-in / token-out result (what verl's rollout server reads from its engine)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, as sampled (after temperature, before top-k/top-p)
    stop_reason: str  # "completed" | "aborted" | "error"
    finish_reason: str | None  # the engine's: "stop" | "length" | "abort" | "error"
    # SamplingParams(return_routed_experts=True): int32 [len(prompt) + len(token_ids) - 1, moe layers, top_k]
    routed_experts: object | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)
    # SamplingParams(prompt_logprobs=k): each prompt token's logprob (None at position 0)
    prompt_logprobs: list | None = None

    @classmethod
    def from_request_output(cls, out: RequestOutput) -> "TokenOutput":
        comp = out.outputs[0]
        lps = [entry[tok].logprob for tok, entry in zip(comp.token_ids, comp.logprobs or [])]
        reason = {"abort": "aborted", "error": "error"}.get(comp.finish_reason, "completed")
        plp = None if out.prompt_logprobs is None else [
            None if entry is None else entry[tok].logprob for tok, entry in zip(out.prompt_token_ids, out.prompt_logprobs)]
        return cls(out.request_id, list(out.prompt_token_ids), list(comp.token_ids), lps, reason,
                   comp.finish_reason, comp.routed_experts, error=out.error, prompt_logprobs=plp)


class RolloutControl:
    """Held by the LLMEngine (``engine.rl``); every method runs in the thread that steps the engine."""

    def __init__(self, engine):
        # a proxy, not a reference: the engine holds this object, and a cycle would keep a dropped engine
        # (its weights and KV cache, GiBs on a GPU) alive until the cyclic garbage collector runs
        self.engine = weakref.proxy(engine)
        self.weights_asleep = False
        self.kv_asleep = False
        self.sleep_level: int | None = None
        self.paused: str | None = None  # None | "abort" | "keep"

    # ---- state -------------------------------------------------------------------------------------
    def is_sleeping(self) -> bool:
        return self.weights_asleep or self.kv_asleep

    def check_can_admit(self) -> None:
        """Raise (RuntimeError naming the state) where a new request cannot be served now."""
        if self.is_sleeping():
            asleep = [t for t, a in (("weights", self.weights_asleep), ("kv_cache", self.kv_asleep)) if a]
            raise RuntimeError(f"the engine is sleeping (sleep(level={self.sleep_level}); asleep: {asleep}): "
                               "call wake_up() before generating")
        if self.paused is not None:
            raise RuntimeError(f"generation is paused (pause_generation(mode={self.paused!r}) or "
                               "abort_all_requests()): call resume_generation() before generating")

    def _rpc(self, fn, *args) -> list:
        return self.engine.executor.collective_rpc(fn, args=args)

    # ---- sleep / wake ------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 (weights to host memory, KV cache discarded) or 2 (both "
                             f"discarded), got {level!r}")
        n = self.engine.get_num_unfinished_requests()
        if n:
            raise RuntimeError(f"sleep: {n} request(s) unfinished; let them finish or call abort_all_requests() "
                               "first (sleeping discards the KV cache they use)")
        self._rpc(rank_memory.sleep_rank, level)
        self.engine.block_manager.reset_prefix_cache()  # the cached blocks' contents are gone
        if not self.weights_asleep:
            self.sleep_level = level
        self.weights_asleep = self.kv_asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = rank_memory._check_tags(tags)
        self._rpc(rank_memory.wake_up_rank, list(tags))
        if "weights" in tags:
            self.weights_asleep = False
        if "kv_cache" in tags and self.kv_asleep:
            self.engine.block_manager.reset_prefix_cache()  # fresh zeros: nothing cached is there
            self.kv_asleep = False
        if not self.is_sleeping():
            self.sleep_level = None

    # ---- weights -----------------------------------------------------------------------------------
    def update_weights(self, weights) -> list[str]:
        """(HF checkpoint name, full tensor) pairs, any subset, any order; each rank takes its shard. All or
        nothing (ValueError naming the tensor). Returns the parameter names written."""
        if isinstance(weights, dict):
            weights = weights.items()
        items = list(weights)
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError(f"weights[{i}]: expected a (name, tensor) pair, got {type(item).__name__}")
        if self.weights_asleep:
            raise RuntimeError("update_weights: the weights are asleep (sleep() was called); "
                               "wake_up(tags=['weights']) first")
        self.engine.executor.driver_rpc("check_weights", items)  # rank 0, in this process: raises before any rank writes
        written = self._rpc(rank_memory.update_weights_rank, items)[0]
        self.reset_prefix_cache()
        return written

    def update_weights_from_disk(self, path: str) -> list[str]:
        """Every tensor of a safetensors checkpoint directory (HF names; a subset of the model's is fine).
        Only files inside ``path`` are read (an index naming ``../`` or an absolute path is refused). Every
        file is checked before any rank writes: its size and header, then each tensor's name, shape and
        dtype against the model; a ValueError names ``path``, the file and the tensor. Then each rank
        streams the files itself."""
        from turnout.loader.safetensors import checked_headers, safetensors_files

        if self.weights_asleep:
            raise RuntimeError("update_weights_from_disk: the weights are asleep (sleep() was called); "
                               "wake_up(tags=['weights']) first")
        if not isinstance(path, str) or not path:
            raise ValueError(f"path: a checkpoint directory, got {path!r}")
        try:
            files = safetensors_files(path)
        except ValueError as e:  # no checkpoint there, a malformed index, a shard outside the directory
            raise ValueError(f"path: {e}") from None
        except OSError as e:  # unreadable (permissions, a directory where the index should be, ...)
            raise ValueError(f"path: {e.filename or path}: {e.strerror or e}") from None
        for f in files:
            try:
                self.engine.executor.driver_rpc("check_weights", checked_headers(f))
            except ValueError as e:  # the file's own check names it; the model's names the tensor
                raise ValueError(f"path: {e}" if str(f) in str(e) else f"path: {f}: {e}") from None
        written = self._rpc(rank_memory.update_weights_from_disk_rank, [str(f) for f in files])[0]
        self.reset_prefix_cache()
        return written

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 backend: str = "gloo", timeout: float | None = None) -> list[int]:
        """Every engine rank joins the trainer's broadcast group (turnout/worker/weight_broadcast.py) as
        ``rank_offset + its rank``; waits until the trainer (rank 0, hosting the store) has joined too, at most
        ``timeout`` seconds (default ``DEFAULT_TIMEOUT_S``), then TimeoutError with nothing joined."""
        deadline = self.wait_for_trainer(master_address, master_port, rank_offset, world_size, backend, timeout)
        return self.join_weight_update_group(master_address, master_port, rank_offset, world_size, backend, deadline)

    def wait_for_trainer(self, master_address, master_port, rank_offset, world_size, backend="gloo",
                         timeout=None) -> float:
        """The arguments checked, then wait (any thread: it touches no engine state) until the trainer's store
        accepts connections. Returns the deadline (``time.monotonic()``) the join must keep."""
        from turnout.worker.weight_broadcast import BACKENDS, DEFAULT_TIMEOUT_S, wait_for_listener

        if backend not in BACKENDS:
            raise ValueError(f"backend: one of {list(BACKENDS)}, got {backend!r}")
        if not isinstance(master_address, str) or not master_address:
            raise ValueError(f"master_address: a host name or address, got {master_address!r}")
        if not (isinstance(master_port, int) and 0 < master_port < 65536):
            raise ValueError(f"master_port: must be in [1, 65535], got {master_port!r}")
        n = self.engine.executor.world_size
        if not (isinstance(rank_offset, int) and rank_offset >= 1 and rank_offset + n <= world_size):
            raise ValueError(f"rank_offset: engine ranks {rank_offset}..{rank_offset + n - 1} must lie in "
                             f"[1, world_size={world_size}) (the trainer is rank 0)")
        timeout = _check_timeout(timeout, DEFAULT_TIMEOUT_S)
        deadline = time.monotonic() + timeout
        wait_for_listener(master_address, master_port, timeout)
        return deadline

    def join_weight_update_group(self, master_address, master_port, rank_offset, world_size, backend,
                                 deadline: float) -> list[int]:
        """The ranks' half (the engine's thread): build the group within what is left of ``deadline``."""
        from turnout.worker.weight_broadcast import raise_timed_out

        left = max(deadline - time.monotonic(), 1.0)  # the store answered: a rendezvous takes milliseconds
        results = self._rpc(rank_memory.init_weight_update_group_rank, master_address, int(master_port),
                            rank_offset, world_size, backend, left)
        try:
            return raise_timed_out(results)
        except TimeoutError:
            self.destroy_weight_update_group()  # the ranks that did join hold a group missing members
            raise

    def update_weights_from_distributed(self, names, dtypes, shapes, timeout: float | None = None) -> list[str]:
        """Receive the announced tensors (in this order) from the trainer's broadcasts, then write them: as
        ``update_weights``, the names and shapes checked before any rank receives. Each tensor must arrive
        within ``timeout`` seconds (default ``DEFAULT_TIMEOUT_S``), else TimeoutError, nothing written and the
        group dropped (``init_weight_update_group`` again)."""
        from turnout.worker.weight_broadcast import DEFAULT_TIMEOUT_S, meta_weights, raise_timed_out

        if self.weights_asleep:
            raise RuntimeError("update_weights_from_distributed: the weights are asleep (sleep() was called); "
                               "wake_up(tags=['weights']) first")
        timeout = _check_timeout(timeout, DEFAULT_TIMEOUT_S)
        self.engine.executor.driver_rpc("check_weights", meta_weights(names, dtypes, shapes))
        results = self._rpc(rank_memory.update_weights_from_distributed_rank, list(names),
                            [str(d) for d in dtypes], [tuple(int(x) for x in s) for s in shapes], timeout)
        try:
            written = raise_timed_out(results)[0]
        except TimeoutError:
            self.destroy_weight_update_group()  # every rank's, not only those that timed out
            raise
        self.reset_prefix_cache()
        return written

    def update_weights_from_ipc(self, buckets) -> list[str]:
        """Tensors shared by handle from another process (turnout/worker/weight_ipc.py): one ``IPCBucket`` per
        engine rank (or one bucket in a world of one). Checked on the driver before any rank maps its bucket."""
        from turnout.worker.weight_broadcast import meta_weights
        from turnout.worker.weight_ipc import IPCBucket, check_bucket

        if self.weights_asleep:
            raise RuntimeError("update_weights_from_ipc: the weights are asleep (sleep() was called); "
                               "wake_up(tags=['weights']) first")
        buckets = [buckets] if isinstance(buckets, IPCBucket) else list(buckets)
        n = self.engine.executor.world_size
        if len(buckets) != n:
            raise ValueError(f"buckets: one per engine rank ({n}), got {len(buckets)}")
        for b in buckets:
            check_bucket(b)
            self.engine.executor.driver_rpc("check_weights", meta_weights(b.names, b.dtypes, b.shapes))
        written = self._rpc(rank_memory.update_weights_from_ipc_rank, buckets)[0]
        self.reset_prefix_cache()
        return written

    def destroy_weight_update_group(self) -> None:
        self._rpc(rank_memory.destroy_weight_update_group_rank)

    def reset_prefix_cache(self) -> int:
        """Make every cached prefix unreachable (blocks in use included). Returns the blocks forgotten."""
        return self.engine.block_manager.forget_prefix_cache()

    # ---- pause / abort / resume --------------------------------------------------------------------
    def abort_all_requests(self) -> list[RequestOutput]:
        """End every unfinished request now; their outputs (partial tokens and logprobs, finish_reason
        "abort"), in admission order. Pauses admission until ``resume_generation``."""
        outs = self._abort_all()
        self.paused = "abort"
        return outs

    def _abort_all(self) -> list[RequestOutput]:
        engine = self.engine
        rids = list(engine.output_processor.requests)
        outs = []
        for rid in rids:
            out = engine.output_processor.finish_aborted(rid)
            engine.core.abort(rid)
            if out is not None:
                outs.append(out)
        if rids:
            logger.info("aborted %d request(s)", len(rids))
        return outs

    def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {list(PAUSE_MODES)}, got {mode!r}")
        if mode == "abort":
            return self.abort_all_requests()
        self.paused = "keep"
        return []

    def resume_generation(self) -> None:
        self.paused = None


def _check_timeout(timeout, default: float) -> float:
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
        raise ValueError(f"timeout: seconds > 0, got {timeout!r}")
    return float(timeout)
