"""The runner's side of the KV tiers: the host caches and the copies between them and the device cache.

The block manager and the scheduler decide (plain Python: kv/block_manager.py, kv/tiers.py,
engine/scheduler.py); this moves the bytes, through the swap ops of the dispatch layer. Three ways to
bring blocks back in, the first the op table serves (each one skipped is named with why at start-up):

1. ``async per layer`` (``swap_layer_async``): each layer's copy is queued ``ASYNC_AHEAD`` layers ahead of
   the forward on a side stream, which first waits for the work already queued on the compute stream (the
   blocks' previous owner); the forward waits on layer i's own event just before layer i
   (``LayerGatedCaches``, worker/layer_gate.py), so the copy of layer i+1 runs while layer i computes.
2. ``sync per layer`` (``swap_layer``): layer i's copy runs in line, just before layer i.
3. ``whole cache`` (``swap_blocks``, one tensor at a time): every layer before the forward.

Copies out (swap-outs, evictions to the host prefix tier) run in line on the compute stream before
anything else of the step, so they read the blocks before the step can overwrite them. With none of
the ops, swap preemption and the host tier are refused at start-up with the reasons (auto preempts by
recompute, logged). The CPU has no streams: there the async op is unavailable, with that reason.

A swap op whose implementation raises on its first call (the dispatch layer's guard then either refuses to
retry it, the destination being too large to keep a copy of, or has no other implementation of that op) is
dropped here and the same copy is run again with the
next op (async -> sync -> whole cache; copies out: sync -> async in line -> whole cache), logged once.
That is safe because no copy writes its source: a swap-in reads the host blocks, a swap-out the device
blocks, and the retry overwrites whatever the failed call left in the destination blocks. Under a strict
ops policy there is no such fallback (the guard's error is raised).

Under tensor parallelism every rank holds its shard of each block (its KV heads) and its own host caches of the
same block count; the driver rank's runner sends each step's swap-outs and swap-ins to the other ranks (step
messages, turnout/worker/step_codec.py) ahead of the step, and each rank runs them through its own op table
and gate. The start-up measurements of auto (worker/kv_measure.py) run on every rank at the same point (the
probe forward's collectives meet); the driver's decide.
"""

from __future__ import annotations

import logging
import weakref

import torch

from turnout.kv.preemption import Preemption
from turnout.ops import OpFailedError, OpUnavailableError
from turnout.worker import kv_measure
from turnout.worker.kv_sizing import allocate_caches, block_caches, state_caches
from turnout.worker.layer_gate import LayerGate

logger = logging.getLogger(__name__)

# (how it is named in the log, the op), in the order tried
# what the dispatch guard raises when a swap op's first call failed and it does not retry it itself
FIRST_CALL_FAILED = (OpFailedError, OpUnavailableError)
STRATEGIES = (("async per layer", "swap_layer_async"), ("sync per layer", "swap_layer"), ("whole cache", "swap_blocks"))
# the ops a copy that runs in line (every copy out; a sync swap-in) tries, in order
IN_LINE = ("swap_layer", "swap_layer_async", "swap_blocks")
# how many layers' async copies are issued ahead of the layer the forward is about to run
ASYNC_AHEAD = 4


def choose_strategy(ops, failed: dict[str, str] | None = None) -> tuple[tuple[str, str] | None, list[tuple[str, str]]]:
    """The first strategy the op table serves (and that has not ``failed``: op -> why), and (op, why) of
    each one skipped before it (all of them when none is served)."""
    skipped = []
    failed = failed or {}
    for name, op in STRATEGIES:
        if ops.available(op) and op not in failed:
            return (name, op), skipped
        res = ops.resolutions.get(op)
        if res is not None and res.not_needed and op not in failed:
            continue  # nothing to skip: this platform has no use for it (e.g. no device streams to overlap on)
        why = failed.get(op) or ("not in the op table" if res is None else (res.error or "no implementation"))
        skipped.append((op, why))
    return None, skipped


class KVTransfer:
    """Host caches sized from the config, the swap strategy, and the start-up measurements for auto."""

    def __init__(self, runner, config):
        self.runner = weakref.proxy(runner)  # the runner owns this: no cycle keeping a dropped runner's memory
        self.ops = runner.ops
        self.failed: dict[str, str] = {}  # swap ops that raised on their first call -> why (never used again)
        self.strategy, self.skipped = choose_strategy(self.ops)
        mode = config.preemption_mode
        why_not = None
        if self.strategy is None:
            why_not = "no swap op can run here (" + "; ".join(f"{op}: {why}" for op, why in self.skipped) + ")"
        bb = runner.block_bytes
        if why_not is not None:
            if mode == "swap":
                raise ValueError(f"preemption_mode: 'swap' cannot run: {why_not}")
            if config.kv_offload_gb > 0:
                raise ValueError(f"kv_offload_gb: the host prefix tier cannot run: {why_not}")
            if mode == "auto":
                logger.info("preemption by recompute (preemption_mode auto): %s", why_not)
            mode = "recompute"
        self.num_swap_blocks = int(config.swap_space * 2**30 // bb) if mode != "recompute" else 0
        if mode == "swap" and self.num_swap_blocks == 0:
            raise ValueError(f"swap_space: {config.swap_space} GiB hold no KV block of {bb} bytes")
        if mode == "auto" and self.num_swap_blocks == 0:
            mode = "recompute"
        self.num_offload_blocks = int(config.kv_offload_gb * 2**30 // bb)
        if config.kv_offload_gb > 0 and self.num_offload_blocks == 0:
            raise ValueError(f"kv_offload_gb: {config.kv_offload_gb} GiB hold no KV block of {bb} bytes")
        if self.num_offload_blocks and not config.enable_prefix_caching:
            raise ValueError("kv_offload_gb: the host prefix tier needs enable_prefix_caching")
        self.mode = mode
        self.num_host_blocks = self.num_swap_blocks + self.num_offload_blocks
        # a swapped-out sequence's per-request state (recurrent layers) waits in a host slot of its own
        self.num_host_state_slots = runner.num_state_slots if self.num_swap_blocks else 0
        self.host_caches = self._host_caches(self.num_host_blocks)
        dev = runner.device
        self._mod = getattr(torch, dev.type, None)
        self._stream = None
        if self.strategy is not None and self.strategy[1] == "swap_layer_async" and self.num_host_blocks:
            # the side stream copies in run on, at high priority: a copy kernel's programs are scheduled
            # ahead of the forward's as multiprocessors free up, so layer i+1's blocks land before layer i ends
            try:
                self._stream = self._mod.Stream(dev, priority=-1)
            except TypeError:  # a device module whose streams take no priority
                self._stream = self._mod.Stream(dev)
        self.copy_bytes_per_s = self.prefill_tokens_per_s = 0.0
        if mode == "auto":
            self.copy_bytes_per_s, self.prefill_tokens_per_s = kv_measure.measure_costs(self, config)
        self.preemption = Preemption(mode, bb, self.copy_bytes_per_s, self.prefill_tokens_per_s)
        if self.strategy is not None:
            logger.info("KV tiers: preemption %s; swap ops: %s (%s)%s; swap pool %d blocks, host prefix tier %d "
                        "blocks (%.2f GiB host)%s", mode, self.strategy[0], self.strategy[1],
                        "".join(f"; skipped {op}: {why}" for op, why in self.skipped), self.num_swap_blocks,
                        self.num_offload_blocks, self.num_host_blocks * bb / 2**30,
                        f"; measured copy {self.copy_bytes_per_s / 1e9:.2f} GB/s, prefill "
                        f"{self.prefill_tokens_per_s:.0f} tokens/s" if mode == "auto" else "")

    def _host_caches(self, n: int) -> list[tuple[torch.Tensor, ...]]:
        """The device cache's layout (every layer's tensors, the device cache's dtype: fp8 too) in host memory."""
        if n == 0:
            return []
        r = self.runner
        pin = r.device.type == "cuda"  # DMA straight from / to the pages; plain (lazily touched) memory on CPU
        return allocate_caches(r.cache_layout, n, r.block_size, self.num_host_state_slots, "cpu", pin_memory=pin,
                               zero=False, shared=True)

    def _blocks(self) -> tuple[list, list]:
        """Per layer, the (device, host) tensors a block id indexes (none for a state layer)."""
        layout = self.runner.cache_layout
        return block_caches(self.runner.kv_caches, layout), block_caches(self.host_caches, layout)

    def measure_overlap(self, num_blocks: int = 64, tokens: int = 2048, iters: int = 5) -> dict:
        """How much of the per-layer async swap-in hides behind the forward (worker/kv_measure.py)."""
        return kv_measure.measure_overlap(self, num_blocks, tokens, iters)

    # ---- the copies ---------------------------------------------------------------------------
    def _call(self, op: str, src, dst, m, stream=None):
        """One layer's copy (src, dst: its tensors, [k, v] for attention) through ``op``; in line unless ``stream``
        (the async op's). Nothing for a layer without such tensors (a state layer's blocks)."""
        ops = self.ops
        if not src:
            return None
        if op == "swap_layer_async":
            return ops.swap_layer_async(list(src), list(dst), m, **({"stream": stream} if stream is not None else {}))
        if op == "swap_layer":
            return ops.swap_layer(list(src), list(dst), m)
        for s, d in zip(src, dst):
            ops.swap_blocks(s, d, m)
        return None

    def _drop(self, op: str, err: RuntimeError) -> None:
        """``op`` raised on its first call: never use it again, move the strategy on, say so once. With no
        op left, or under a strict ops policy, the error is raised (the engine stops loudly)."""
        if self.ops.policy.strict:
            raise err
        self.failed[op] = f"failed on first use: {err}"
        self.strategy, self.skipped = choose_strategy(self.ops, self.failed)
        if self.strategy is None:
            raise RuntimeError("KV tiers: every swap op failed, no copy between the device and the host can run ("
                               + "; ".join(f"{o}: {why}" for o, why in self.skipped) + ")") from err
        logger.warning("KV tiers: swap op %s failed on its first call, redoing the copy with the next one; swap-ins "
                       "now %s (%s): %s", op, self.strategy[0], self.strategy[1], err)

    def _in_line(self, srcs, dsts, m) -> None:
        """Copies of the given layers in line, through the first in-line op not dropped (a first-call failure
        drops it and redoes these layers with the next)."""
        while True:
            op = next((o for o in IN_LINE if self.ops.available(o) and o not in self.failed), None)
            if op is None:
                raise RuntimeError(f"KV tiers: no swap op left ({self.failed})")
            try:
                for s, d in zip(srcs, dsts):
                    self._call(op, s, d, m)
                return
            except FIRST_CALL_FAILED as e:
                self._drop(op, e)

    def _mapping(self, pairs: list[tuple[int, int]]) -> torch.Tensor:
        """The [N, 2] block mapping, in pinned memory on CUDA: a kernel's copy of it to the device is then
        asynchronous, and a kernel may read it in place."""
        m = torch.tensor(pairs, dtype=torch.long)
        return m.pin_memory() if self.runner.device.type == "cuda" else m

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) copies, in line on the compute stream."""
        if not pairs:
            return
        dev, host = self._blocks()
        self._in_line(dev, host, self._mapping(pairs))

    def swap_states(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Per-request states of recurrent layers (kv/state_slots.py): (device slot, host slot) copies out, or
        (host slot, device slot) copies in, in line on the compute stream, in the order of the block copies."""
        if not pairs:
            return
        layout = self.runner.cache_layout
        dev, host = state_caches(self.runner.kv_caches, layout), state_caches(self.host_caches, layout)
        src, dst = (dev, host) if to_host else (host, dev)
        self._in_line(src, dst, self._mapping(pairs))

    def swap_in(self, pairs: list[tuple[int, int]]) -> LayerGate | None:
        """(host block, device block) copies before this step's forward reads them: a gate the forward
        passes layer by layer, or None once they are all queued in line (whole cache)."""
        if not pairs:
            return None
        m = self._mapping(pairs)
        caches, host = self._blocks()
        if self.strategy[1] == "swap_layer_async":
            main = self._mod.current_stream(self.runner.device)
            self._stream.wait_stream(main)  # the blocks' previous owner's work (reads and writes) comes first
            try:
                events = [self._call("swap_layer_async", host[0], caches[0], m, self._stream)]
            except FIRST_CALL_FAILED as e:  # its first call: nothing of it is waited on; the next strategy redoes it
                self._drop("swap_layer_async", e)
                return self.swap_in(pairs)
            return LayerGate(len(caches), self._async_layers(main, host, caches, m, events))
        if self.strategy[1] == "swap_layer":
            return LayerGate(len(caches), lambda i: self._in_line([host[i]], [caches[i]], m))
        self._in_line(host, caches, m)
        return None

    def _async_layers(self, main, host, caches, m, events):
        """The gate's action for the async strategy: issue the copies up to layer i + ASYNC_AHEAD, then make
        the compute stream wait for layer i's. Issued a few layers ahead of the forward rather than all before
        it, the copies' host time (a launch per layer) is spread among the forward's own launches instead of
        delaying its first one (on an H200, issuing 36 layers up front delayed the forward by about the
        copy's whole duration: docs/benchmarks.md, "H200: KV swaps as one kernel a layer"). A copy that fails on its first call drops the op; the
        layers not yet issued are copied in line, on the compute stream."""
        n = len(caches)

        def issue(upto: int) -> None:
            while len(events) < min(upto, n):
                j = len(events)
                if self.strategy is None or self.strategy[1] != "swap_layer_async":
                    self._in_line(host[j:], caches[j:], m)
                    events.extend([None] * (n - j))
                    return
                try:
                    events.append(self._call("swap_layer_async", host[j], caches[j], m, self._stream))
                except FIRST_CALL_FAILED as e:
                    self._drop("swap_layer_async", e)

        issue(ASYNC_AHEAD)

        def before(i: int) -> None:
            issue(i + 1 + ASYNC_AHEAD)
            if events[i] is not None:
                main.wait_event(events[i])
        return before
