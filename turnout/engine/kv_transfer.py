"""The runner's side of the KV tiers: the host caches and the copies between them and the device cache.

The block manager and the scheduler decide (plain Python: kv/block_manager.py, kv/tiers.py,
engine/scheduler.py); this moves the bytes, through the swap ops of the dispatch layer. Three ways to
bring blocks back in, the first the op table serves (each one skipped is named with why at start-up):

1. ``async per layer`` (``swap_layer_async``): every layer's copy is queued at once on a side stream,
   which first waits for the work already queued on the compute stream (the blocks' previous owner);
   the forward waits on layer i's own event just before layer i (``LayerGatedCaches``), so the copy of
   layer i+1 runs while layer i computes.
2. ``sync per layer`` (``swap_layer``): layer i's copy runs in line, just before layer i.
3. ``whole cache`` (``swap_blocks``, one tensor at a time): every layer before the forward.

Copies out (swap-outs, evictions to the host prefix tier) run in line on the compute stream before
anything else of the step, so they read the blocks before the step can overwrite them. With none of
the ops, swap preemption and the host tier are refused at start-up with the reasons (auto preempts by
recompute, logged). The CPU has no streams: there the async op is unavailable, with that reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from turnout.engine.scheduler import Preemption
from turnout.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

# (how it is named in the log, the op), in the order tried
STRATEGIES = (("async per layer", "swap_layer_async"), ("sync per layer", "swap_layer"), ("whole cache", "swap_blocks"))


def choose_strategy(ops) -> tuple[tuple[str, str] | None, list[tuple[str, str]]]:
    """The first strategy the op table serves, and (op, why) of each one skipped before it (all of them
    when none is served)."""
    skipped = []
    for name, op in STRATEGIES:
        if ops.available(op):
            return (name, op), skipped
        res = ops.resolutions.get(op)
        why = "not in the op table" if res is None else (res.error or "no implementation")
        skipped.append((op, why))
    return None, skipped


class LayerGate:
    """What must happen before layer i of this step's forward reads its cache: wait for its async copy
    (an event), or run its in-line copy. Each layer's action runs once."""

    def __init__(self, num_layers: int, before):
        self._before = before  # before(i): the layer's wait or copy
        self._done = [False] * num_layers

    def layer(self, i: int) -> None:
        if not self._done[i]:
            self._done[i] = True
            self._before(i)

    def finish(self) -> None:
        """Every layer's wait or copy (before a CUDA-graph replay, which reads every layer)."""
        for i in range(len(self._done)):
            self.layer(i)


class LayerGatedCaches(Sequence):
    """The per-layer caches as the model sees them for one step: fetching layer i (the decoder zips its
    layers with this, so layer i is fetched just before it runs) first passes that layer's gate."""

    def __init__(self, caches, gate: LayerGate):
        self._caches, self._gate = caches, gate

    def __len__(self) -> int:
        return len(self._caches)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        self._gate.layer(i if i >= 0 else len(self) + i)
        return self._caches[i]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


class KVTransfer:
    """Host caches sized from the config, the swap strategy, and the start-up measurements for auto."""

    def __init__(self, runner, config):
        self.runner = runner
        self.ops = runner.ops
        self.strategy, self.skipped = choose_strategy(self.ops)
        mode = config.preemption_mode
        why_not = None
        if self.strategy is None:
            why_not = "no swap op can run here (" + "; ".join(f"{op}: {why}" for op, why in self.skipped) + ")"
        elif config.tensor_parallel_size > 1:
            why_not = "swapping under tensor parallelism is not built yet"
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
        self.host_caches = self._host_caches(self.num_host_blocks)
        dev = runner.device
        self._mod = getattr(torch, dev.type, None)
        self._stream = None
        if self.strategy is not None and self.strategy[1] == "swap_layer_async" and self.num_host_blocks:
            self._stream = self._mod.Stream(dev)  # the side stream copies in run on
        self.copy_bytes_per_s = self.prefill_tokens_per_s = 0.0
        if mode == "auto":
            self._measure(config)
        self.preemption = Preemption(mode, bb, self.copy_bytes_per_s, self.prefill_tokens_per_s)
        if self.strategy is not None:
            logger.info("KV tiers: preemption %s; swap ops: %s (%s)%s; swap pool %d blocks, host prefix tier %d "
                        "blocks (%.2f GiB host)%s", mode, self.strategy[0], self.strategy[1],
                        "".join(f"; skipped {op}: {why}" for op, why in self.skipped), self.num_swap_blocks,
                        self.num_offload_blocks, self.num_host_blocks * bb / 2**30,
                        f"; measured copy {self.copy_bytes_per_s / 1e9:.2f} GB/s, prefill "
                        f"{self.prefill_tokens_per_s:.0f} tokens/s" if mode == "auto" else "")

    def _host_caches(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if n == 0:
            return []
        r = self.runner
        pin = r.device.type == "cuda"  # DMA straight from / to the pages; plain (lazily touched) memory on CPU
        shape = (n, r.block_size, r.num_kv_heads, r.head_dim)
        return [(torch.empty(shape, dtype=r.dtype, pin_memory=pin), torch.empty(shape, dtype=r.dtype, pin_memory=pin))
                for _ in range(r.num_layers)]

    def _sync(self) -> None:
        if self.runner.device.type != "cpu":
            self.runner.platform.synchronize()

    @torch.inference_mode()
    def _measure(self, config) -> None:
        """Copy bandwidth (a few blocks out and back) and prefill rate (one short forward into blocks
        nothing owns yet), each the best of two runs: cheap, and enough to compare the two costs."""
        r = self.runner
        n = max(1, min(8, self.num_host_blocks, r.num_blocks))
        pairs = [(i, i) for i in range(n)]
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            self.swap_out(pairs)
            gate = self.swap_in(pairs)
            if gate is not None:
                gate.finish()
            self._sync()
            best = min(best, time.perf_counter() - t0)
        self.copy_bytes_per_s = 2 * n * r.block_bytes / best
        tokens = max(1, min(32, config.max_num_batched_tokens, r.num_blocks * r.block_size, r.max_model_len))
        dev = r.device
        nb = -(-tokens // r.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(tokens, dtype=torch.long, device=dev),
            block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
            max_query_len=tokens, max_seq_len=tokens)
        ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            r.model(ids, torch.arange(tokens, device=dev), r.kv_caches, meta)
            self._sync()
            best = min(best, time.perf_counter() - t0)
        self.prefill_tokens_per_s = tokens / best

    # ---- the copies ---------------------------------------------------------------------------
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) copies, in line on the compute stream."""
        if not pairs:
            return
        m = torch.tensor(pairs, dtype=torch.long)
        ops = self.ops
        for (k, v), (hk, hv) in zip(self.runner.kv_caches, self.host_caches):
            if ops.available("swap_layer"):
                ops.swap_layer([k, v], [hk, hv], m)
            elif ops.available("swap_layer_async"):
                ops.swap_layer_async([k, v], [hk, hv], m)  # on the current stream: in line
            else:
                ops.swap_blocks(k, hk, m)
                ops.swap_blocks(v, hv, m)

    def swap_in(self, pairs: list[tuple[int, int]]) -> LayerGate | None:
        """(host block, device block) copies before this step's forward reads them: a gate the forward
        passes layer by layer, or None once they are all queued in line (whole cache)."""
        if not pairs:
            return None
        m = torch.tensor(pairs, dtype=torch.long)
        ops, caches, host = self.ops, self.runner.kv_caches, self.host_caches
        name = self.strategy[1]
        if name == "swap_layer_async":
            main = self._mod.current_stream(self.runner.device)
            self._stream.wait_stream(main)  # the blocks' previous owner's work (reads and writes) comes first
            events = [ops.swap_layer_async(list(h), list(c), m, stream=self._stream) for h, c in zip(host, caches)]
            return LayerGate(len(caches), lambda i: main.wait_event(events[i]))
        if name == "swap_layer":
            return LayerGate(len(caches), lambda i: ops.swap_layer(list(host[i]), list(caches[i]), m))
        for (hk, hv), (k, v) in zip(host, caches):
            ops.swap_blocks(hk, k, m)
            ops.swap_blocks(hv, v, m)
        return None
