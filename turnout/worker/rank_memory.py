"""One rank's side of the RL control plane: sleep / wake of its weights and KV cache, and in-place weight
updates. Every operation is a method of ``RankMemory`` (one per ModelRunner, ``runner.memory``) and a
function below taking the worker first, which is what the engine hands to ``executor.collective_rpc``: the
uniproc executor calls it on its one worker, the mp executor on every rank, each rank loading its own shard
of the full tensors through its layers' weight loaders.

What sleeping releases, and what stays:

- ``sleep(1)``: every parameter's values go to host memory (pinned on a GPU, so ``wake_up`` is one fast
  copy back; on the host the tensors themselves are kept, there is nowhere cheaper to put them) and the
  parameter is left an empty tensor; the KV cache tensors are dropped. ``sleep(2)``: the weights are dropped
  too (the trainer pushes new ones after ``wake_up``). Buffers (the rotary cos/sin cache) stay: derived from
  the config, a few MB, and not recomputable from the checkpoint names an update sends.
- On a GPU the captured decode graphs are dropped as well, then ``empty_cache`` hands the freed blocks back
  to the device (not only to torch's caching allocator). CUDA graphs bake in the addresses of the weights,
  the KV cache and their own pool; torch offers no public way to unmap physical memory while keeping a
  virtual address range (vLLM's CuMem allocator does it with the driver API), so an address cannot be kept
  across a real release. The graphs are therefore re-captured (``cuda_graphs.maybe_capture``, the same path
  as at start-up) once both weights and KV cache are awake again. A weight update while awake writes in
  place (turnout/models/weight_map.py ``update_weights``), so it keeps every address and needs no re-capture.
- Waking restores each parameter with its own shape, strides and dtype (``empty_strided``), so a re-layout
  done after loading (K-major CPU weights, turnout/layers/layout.py) survives a sleep without being redone.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from turnout.utils.gc_freeze import release_device_memory

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")


@dataclass
class _Saved:
    """A parameter while asleep: its layout and, after sleep(1), its values on the host."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    host: torch.Tensor | None


def _unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters())  # tied parameters once, under their first name


class RankMemory:
    """Sleep state of one rank's model runner (weights, KV cache, decode graphs)."""

    def __init__(self, runner):
        self.runner = weakref.proxy(runner)  # the runner owns this: no cycle keeping a dropped runner's memory
        self.weights_asleep = False
        self.kv_asleep = False
        self.weights_discarded = False  # woken from sleep(2): values undefined until an update writes them
        self._saved: dict[str, _Saved] = {}
        self.weight_group = None  # the trainer's broadcast group (turnout/worker/weight_broadcast.py), once joined

    @property
    def is_sleeping(self) -> bool:
        return self.weights_asleep or self.kv_asleep

    def resident_bytes(self) -> dict[str, int]:
        """Bytes held by this rank's parameters, KV cache and host copies (storage sizes: what is really held)."""
        r = self.runner
        params = sum(p.untyped_storage().nbytes() for _, p in _unique_params(r.model))
        kv = sum(t.untyped_storage().nbytes() for t in {id(t): t for layer in r.kv_caches for t in layer}.values())
        host = sum(s.host.untyped_storage().nbytes() for s in self._saved.values() if s.host is not None)
        return {"weights": params, "kv_cache": kv, "host_weights": host}

    # ---- sleep -------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict[str, int]:
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 (weights to host memory, KV cache discarded) or 2 (both "
                             f"discarded), got {level!r}")
        t0 = time.perf_counter()
        r = self.runner
        before = self.resident_bytes()
        self._drop_graphs()
        if not self.weights_asleep:
            self._sleep_weights(keep=level == 1)
        if not self.kv_asleep:
            r.kv_caches = []  # the tensors go with the last reference (the graphs held the others)
            self.kv_asleep = True
        release_device_memory(r.device)
        after = self.resident_bytes()
        logger.info("sleep(level=%d) in %.3fs: released %.2f GiB of weights, %.2f GiB of KV cache", level,
                    time.perf_counter() - t0, (before["weights"] - after["weights"]) / 2**30,
                    (before["kv_cache"] - after["kv_cache"]) / 2**30)
        return after

    def _sleep_weights(self, keep: bool) -> None:
        r = self.runner
        pin = r.device.type == "cuda"
        for name, p in _unique_params(r.model):
            host = None
            if keep:
                if p.device.type == "cpu":
                    host = p.data  # already host memory: keep the tensor itself
                else:
                    host = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cpu", pin_memory=pin)
                    host.copy_(p.data, non_blocking=pin)
            self._saved[name] = _Saved(tuple(p.shape), tuple(p.stride()), p.dtype, host)
        if pin:
            torch.cuda.synchronize(r.device)  # the non-blocking copies landed before the device memory goes
        for _, p in _unique_params(r.model):
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.weights_asleep = True

    def _drop_graphs(self) -> None:
        r = self.runner
        if r.graphs is not None:
            for graph in r.graphs.graphs.values():
                graph.reset()  # each graph gives up its share of the private pool now, not at collection
            r.graphs = None  # the static buffers and the addresses the graphs baked in go with it

    # ---- wake --------------------------------------------------------------------------------------
    def wake_up(self, tags: list[str] | None = None) -> dict[str, int]:
        tags = _check_tags(tags)
        t0 = time.perf_counter()
        r = self.runner
        if "weights" in tags and self.weights_asleep:
            discarded = False
            for name, p in _unique_params(r.model):
                s = self._saved.pop(name)
                if s.host is not None and s.host.device == r.device:  # the host is the device: the tensor itself
                    p.data = s.host
                    continue
                dev = torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=r.device)
                if s.host is None:  # sleep(2): the trainer sends the values next
                    dev.zero_()
                    discarded = True
                else:
                    dev.copy_(s.host, non_blocking=s.host.is_pinned())
                p.data = dev
            if r.device.type == "cuda":
                torch.cuda.synchronize(r.device)  # the copies out of the pinned host tensors are done before they go
            self._saved.clear()
            self.weights_asleep = False
            self.weights_discarded = discarded
            if discarded:
                logger.warning("wake_up: the weights were discarded by sleep(level=2); they are zeros until "
                               "update_weights writes them")
        if "kv_cache" in tags and self.kv_asleep:
            from turnout.worker.kv_sizing import allocate_caches

            r.kv_caches = allocate_caches(r.cache_layout, r.num_blocks, r.block_size, r.num_state_slots, r.device,
                                          shared=True)
            self.kv_asleep = False
        if not self.is_sleeping and r.graphs is None:
            from turnout.worker.cuda_graphs import maybe_capture

            if r.device.type == "cuda":
                torch.cuda.synchronize(r.device)
            r.graphs = maybe_capture(r)  # re-captured against the new addresses; None on the host
        logger.info("wake_up(%s) in %.3fs", list(tags), time.perf_counter() - t0)
        return self.resident_bytes()

    # ---- weight updates ----------------------------------------------------------------------------
    def check_weights(self, weights) -> None:
        """The all-or-nothing check alone (the engine runs it on the driver rank before any rank writes, so a
        bad tensor is a ValueError from the caller's own process, whatever the executor)."""
        from turnout.models.weight_map import check_weights

        check_weights(self.runner.model, weights)

    def update_weights(self, weights) -> list[str]:
        """(HF checkpoint name, full tensor) pairs into this rank's shard, in place, all or nothing
        (turnout/models/weight_map.py ``update_weights``). Returns the parameter names written."""
        from turnout.models.weight_map import update_weights

        if self.weights_asleep:
            raise RuntimeError("update_weights: the weights are asleep (sleep() was called); "
                               "wake_up(tags=['weights']) first")
        r = self.runner
        written = update_weights(r.model, weights)
        if r.device.type == "cuda":
            torch.cuda.synchronize(r.device)  # the caller may free or reuse its tensors as soon as this returns
        if written:
            self.weights_discarded = False
        return sorted(written)


def _check_tags(tags) -> tuple[str, ...]:
    if tags is None:
        return TAGS
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags: a list of {list(TAGS)} (or None for both), got {tags!r}")
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"tags: unknown tag(s) {unknown}; known: {list(TAGS)}")
    return tuple(tags)


# ---- what collective_rpc runs on every rank (a callable taking the worker first) ----------------------
def sleep_rank(worker, level: int = 1) -> dict[str, int]:
    return worker.runner.memory.sleep(level)


def wake_up_rank(worker, tags=None) -> dict[str, int]:
    return worker.runner.memory.wake_up(tags)


def update_weights_rank(worker, weights) -> list[str]:
    return worker.runner.memory.update_weights(weights)


def update_weights_from_disk_rank(worker, files: list[str]) -> list[str]:
    """Each rank reads the checkpoint itself (nothing crosses the pipes), tensor by tensor; the engine checked
    the names and shapes from the files' headers first."""
    from turnout.loader.safetensors import iter_safetensors
    from turnout.models.weight_map import update_weights

    mem = worker.runner.memory
    if mem.weights_asleep:
        raise RuntimeError("update_weights_from_disk: the weights are asleep; wake_up(tags=['weights']) first")
    written = update_weights(worker.runner.model, iter_safetensors([Path(f) for f in files]), checked=True)
    mem.weights_discarded = False
    return sorted(written)


def init_weight_update_group_rank(worker, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, backend: str = "gloo", timeout_s: float | None = None) -> int:
    """Join the trainer's group as ``rank_offset + worker.rank`` within ``timeout_s``: that rank, or TimedOut."""
    from turnout.worker.weight_broadcast import TimedOut, stateless_group

    mem = worker.runner.memory
    rank = rank_offset + worker.rank
    try:
        mem.weight_group = stateless_group(master_address, master_port, rank, world_size, backend,
                                           device=worker.runner.device if backend == "nccl" else None,
                                           timeout_s=timeout_s)
    except TimeoutError as e:
        return TimedOut(str(e))
    return rank


def update_weights_from_distributed_rank(worker, names, dtypes, shapes, timeout_s: float | None = None):
    """Receive each announced tensor from the trainer (rank 0 of the group; each within ``timeout_s``), then
    write them all; the engine checked the names and shapes against the model before any rank received.
    A failed broadcast drops the group (it may be out of step), writes nothing and answers ``TimedOut``."""
    from turnout.models.weight_map import update_weights
    from turnout.worker.weight_broadcast import TimedOut, broadcast, meta_weights

    mem, r = worker.runner.memory, worker.runner
    if mem.weight_group is None:
        raise RuntimeError("update_weights_from_distributed: init_weight_update_group() first")
    dev = r.device if mem.weight_group.backend == "nccl" else torch.device("cpu")  # gloo receives on the host
    items = []
    try:
        for name, meta in meta_weights(names, dtypes, shapes):
            buf = torch.empty(meta.shape, dtype=meta.dtype, device=dev)
            broadcast(mem.weight_group, buf, timeout_s)
            items.append((name, buf))
    except TimeoutError as e:
        mem.weight_group = None
        return TimedOut(str(e))
    written = update_weights(r.model, items, checked=True)
    mem.weights_discarded = False
    if r.device.type == "cuda":
        torch.cuda.synchronize(r.device)
    return sorted(written)


def update_weights_from_ipc_rank(worker, buckets) -> list[str]:
    """Map this rank's bucket (``buckets[worker.rank]``), write its tensors, then let go of the mapping."""
    from turnout.models.weight_map import update_weights
    from turnout.worker.weight_ipc import open_bucket

    r = worker.runner
    items = open_bucket(buckets[worker.rank], r.device)
    written = update_weights(r.model, items, checked=True)
    if r.device.type == "cuda":
        torch.cuda.synchronize(r.device)  # read before the trainer may refill the buffer
    del items
    r.memory.weights_discarded = False
    return sorted(written)


def destroy_weight_update_group_rank(worker) -> None:
    worker.runner.memory.weight_group = None


def resident_bytes_rank(worker) -> dict[str, int]:
    return worker.runner.memory.resident_bytes()
