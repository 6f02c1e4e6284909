"""CUDA graphs for decode steps.

A decode step of an 8B model is a few hundred small kernel launches; at batch 1 the launches, not the
GPU, set the pace. ``DecodeGraphs`` captures ``model.forward`` + ``compute_logits`` once per bucketed
batch size and replays them. Only pure-decode steps replay (every scheduled sequence adds one token and
samples); prefill and mixed steps run eagerly.

The static inputs every graph reads (one buffer shared by all buckets, filled each step in one copy) and
their padding lanes are worker/graph_inputs.py; each graph copies its logits into one shared ``logits``
[max_bs, V] f32 (the graphs' outputs share memory, and the graphs share one memory pool for everything
else, captured largest first).

Capture uses ``max_seq_len = max_model_len``: the attention kernels take it as a host int that sizes
their grid, and read each sequence's real length from ``seq_lens`` on the device.

If capture fails (an op that synchronises, e.g. a reference implementation doing ``.item()``), one
warning says why and every step runs eagerly.

Multi-token decode (``num_speculative_tokens`` k > 0: each sequence computes its token and up to k drafts,
worker/step.py) is captured too, per (batch, query length q) for q = 2 .. 1 + k, where every sequence of
the step has the same q and every position draws. Those shapes use the same buffers: token rows
``[:b q]`` (ids, positions, slots, logits), sequence rows ``[:b]``, and a static ``query_start_loc`` per q;
only batches with ``b q`` within the largest bucket are captured. A padding sequence there attends to q
tokens of block 0 (its seq_len is q, so no query position falls before its first token). A failed capture
of these shapes leaves the one-token graphs in place.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from turnout.layers.attention import AttentionMetadata
from turnout.worker.graph_buckets import (  # noqa: F401
    FINE_GRAPH_BATCH,
    MAX_GRAPH_BATCH,
    bucket_for,
    graph_buckets,
    is_graphable,
    multi_token_buckets,
)
from turnout.worker.graph_inputs import StaticInputs

logger = logging.getLogger(__name__)

class DecodeGraphs:
    """One CUDA graph per bucket, one memory pool, static inputs; see the module docstring."""

    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int, device,
                 max_bucket: int = MAX_GRAPH_BATCH, upload_stream=None, max_query_len: int = 1,
                 layer_group: tuple[int, ...] | None = None):
        self.model = model
        self.layer_group = layer_group  # several table groups: each layer's (their tables are graph inputs too)
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.buckets = graph_buckets(max_num_seqs, max_bucket)
        self.max_model_len = int(max_model_len)
        self.max_blocks = math.ceil(self.max_model_len / block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # one-token decode, by batch size
        # multi-token decode (query length q > 1): by q, the batch sizes captured, and the graphs by (batch, q)
        self.multi_buckets = {q: multi_token_buckets(self.buckets, q) for q in range(2, max_query_len + 1)}
        self.multi_buckets = {q: b for q, b in self.multi_buckets.items() if b}
        self.multi: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.disabled_reason: str | None = None
        self.capture_s = 0.0
        self.num_replays = 0
        self.num_multi_token_replays = 0  # of those, at a query length > 1
        self.inputs = StaticInputs(self.buckets[-1], self.max_blocks, self.device, upload_stream,
                                   list(self.multi_buckets), 1 if layer_group is None else 1 + max(layer_group))
        inp = self.inputs  # the buffers the graphs read, under the names capture and the benchmarks use
        self.input_ids, self.positions, self.slot_mapping = inp.input_ids, inp.positions, inp.slot_mapping
        self.seq_lens, self.block_tables, self.query_start_loc = inp.seq_lens, inp.block_tables, inp.query_start_loc
        self.logits: torch.Tensor | None = None  # [max_bs, V] f32, made by the first warm-up (V as computed)

    @property
    def enabled(self) -> bool:
        return bool(self.graphs) and self.disabled_reason is None

    def stats(self) -> dict:
        out = {"enabled": self.enabled, "buckets": sorted(self.graphs), "capture_s": round(self.capture_s, 3),
               "replays": self.num_replays, "disabled_reason": self.disabled_reason}
        if self.multi:
            out["multi_token_shapes"] = sorted(self.multi)
        return out

    def _meta(self, b: int, q: int = 1) -> AttentionMetadata:
        qsl = self.query_start_loc if q == 1 else self.inputs.multi_qsl[q]
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:b * q], block_tables=self.block_tables[:b],
                                 seq_lens=self.seq_lens[:b], query_start_loc=qsl[:b + 1],
                                 max_query_len=q, max_seq_len=self.max_model_len)
        if self.layer_group is not None:  # each further table group's static slots and tables
            meta.group_tables = tuple((s[:b * q], t[:b]) for s, t in self.inputs.group_tables)
            meta.layer_group = self.layer_group
        return meta

    def _forward(self, b: int, q: int = 1) -> None:
        t = b * q
        hidden = self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, self._meta(b, q))
        if self.logits is None:  # the largest bucket's eager warm-up, before any capture
            logits = self.model.compute_logits(hidden)  # [b, V]
            self.logits = torch.empty((self.buckets[-1], logits.shape[-1]), dtype=logits.dtype, device=logits.device)
            self.logits[:t].copy_(logits)
        else:  # straight into the shared buffer: one kernel casts and stores
            self.model.compute_logits(hidden, out=self.logits[:t])

    # ---- capture ---------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> bool:
        """Warm up and capture every bucket, largest first (the smaller ones reuse its pool memory).
        On failure: no graphs, one warning, False."""
        t0 = time.perf_counter()
        dev = self.device
        stream = torch.cuda.Stream(device=dev)
        pool = torch.cuda.graph_pool_handle()
        try:
            torch.cuda.synchronize(dev)
            for b in reversed(self.buckets):
                self.graphs[b] = self._capture_one(stream, pool, b, 1)
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 - any failure means: run eagerly
            self._give_up(e)
            self.capture_s = time.perf_counter() - t0
            return False
        try:
            for q, sizes in self.multi_buckets.items():
                self.seq_lens[:sizes[-1]].fill_(q)  # no query position before a padding sequence's first token
                for b in reversed(sizes):
                    self.multi[(b, q)] = self._capture_one(stream, pool, b, q)
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 - the one-token graphs stay
            self.multi.clear()
            logger.warning("CUDA graphs: multi-token decode runs eagerly: capture failed: %s",
                           f"{type(e).__name__}: {e}".splitlines()[0][:300])
        finally:
            self.seq_lens.fill_(1)
        self.capture_s = time.perf_counter() - t0
        logger.info("CUDA graphs: captured %d decode batch sizes (%s)%s in %.1fs", len(self.graphs),
                    _describe(self.buckets), f" and {len(self.multi)} multi-token shapes" if self.multi else "",
                    self.capture_s)
        return True

    def _capture_one(self, stream, pool, b: int, q: int):
        # Eager warm-up on the capture stream: first op calls settle the op table, Triton compiles and
        # autotunes for this shape, cuBLAS picks its algorithms. None of that may happen inside a capture.
        dev = self.device
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            self._forward(b, q)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            error = None
            try:
                self._forward(b, q)
            except Exception as e:  # noqa: BLE001 - reported below, with the end-capture error
                error = e
            try:
                graph.capture_end()
            except Exception as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise _CaptureError(b if q == 1 else f"{b} x {q} tokens", error)
        return graph

    def _give_up(self, error: Exception) -> None:
        self.graphs.clear()
        reason = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        self.disabled_reason = reason
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - the warning below is what matters
            pass
        logger.warning("CUDA graphs disabled, decode runs eagerly: capture failed: %s. (An op that "
                       "synchronises with the host cannot be captured; `turnout ops` shows the chosen "
                       "implementations; --enforce-eager silences this.)", reason)

    # ---- replay ----------------------------------------------------------------------------
    def can_run(self, num_sampled: int, meta: AttentionMetadata) -> bool:
        n, q = int(meta.seq_lens.shape[0]), meta.max_query_len
        tokens, width = int(meta.slot_mapping.shape[0]), int(meta.block_tables.shape[1])
        if meta.group_tables is not None:  # every group's tables must fit the static ones
            width = max([width] + [int(t.shape[1]) for _, t in meta.group_tables])
        if q == 1 or not self.enabled:
            return self.enabled and is_graphable(tokens, n, num_sampled, q, width, self.max_blocks, self.buckets)
        # every sequence q tokens (n q tokens, none longer than q), every position draws
        b = bucket_for(n, self.multi_buckets.get(q, []))
        return tokens == n * q == num_sampled and width <= self.max_blocks and (b, q) in self.multi

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions and meta on the host (pinned): one async copy each into the static
        buffers, then replay. input_ids may also be on the device (a lookahead step's inputs: the
        previous step's sampled tokens). Returns logits [tokens, vocab] f32, a view valid until the next replay."""
        t, n, q = int(input_ids.shape[0]), int(meta.seq_lens.shape[0]), meta.max_query_len
        b = bucket_for(n, self.buckets if q == 1 else self.multi_buckets[q])
        self.inputs.load(input_ids, positions, meta, b)
        (self.graphs[b] if q == 1 else self.multi[(b, q)]).replay()
        self.num_replays += 1
        self.num_multi_token_replays += q > 1
        return self.logits[:t]


class _CaptureError(RuntimeError):
    def __init__(self, bucket: int, error: Exception):
        super().__init__(f"batch size {bucket}: {type(error).__name__}: {error}")


def _describe(buckets: list[int]) -> str:
    return ", ".join(map(str, buckets)) if len(buckets) <= 6 else f"{buckets[0]}..{buckets[-1]}"


def maybe_capture(runner) -> DecodeGraphs | None:
    """The model runner's hook: DecodeGraphs when graphs may be used here, captured; else None."""
    config, platform = runner.config, runner.platform
    if config.enforce_eager:
        logger.info("CUDA graphs: off (enforce_eager)")
        return None
    if not platform.supports_graphs() or runner.device.type != "cuda":
        logger.info("CUDA graphs: not supported on %s; running eagerly", platform.name)
        return None
    if getattr(runner, "hidden_capture", None) is not None:  # its hooks read each forward's hidden states
        logger.info("CUDA graphs: off (the speculative drafter reads the target's hidden states); running eagerly")
        return None
    if getattr(runner.model, "no_cuda_graphs", None):  # the model says why it cannot be captured
        logger.info("CUDA graphs: off (%s); running eagerly", runner.model.no_cuda_graphs)
        return None
    graphs = DecodeGraphs(runner.model, runner.kv_caches, config.max_num_seqs, runner.max_model_len,
                          runner.block_size, runner.device, upload_stream=runner._upload,
                          max_query_len=1 + getattr(config, "num_speculative_tokens", 0),
                          layer_group=runner.layer_group)
    graphs.capture()
    return graphs
