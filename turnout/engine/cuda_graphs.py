"""CUDA graphs for decode steps.

A decode step of an 8B model is a few hundred small kernel launches; at batch 1 the launches, not the
GPU, set the pace. ``DecodeGraphs`` captures ``model.forward`` + ``compute_logits`` once per bucketed
batch size and replays them. Only pure-decode steps replay (every scheduled sequence adds one token and
samples); prefill and mixed steps run eagerly.

Static buffers, shared by all buckets (bucket ``b`` uses rows ``[:b]``):
``input_ids``, ``positions``, ``slot_mapping`` [max_bs]; ``block_tables`` [max_bs, max_blocks_per_seq];
``seq_lens`` [max_bs]; ``query_start_loc`` [max_bs + 1] = 0, 1, 2, ... (one token a lane, never changes);
``logits`` [max_bs, V] f32 (each graph copies its logits there: the graphs' outputs share memory, and
the graphs share one memory pool for everything else, captured largest first).

Padding lanes (rows ``n .. b-1`` of a batch of ``n`` replayed in bucket ``b``) write nowhere (slot -1) and
attend to one token of block 0 (seq_len 1, a valid block id): finite garbage that nobody reads. The
invariant: every row at or beyond the last live batch size holds padding values; shrinking re-pads the
rows just left (two small fills), growing overwrites them.

Capture uses ``max_seq_len = max_model_len``: the attention kernels take it as a host int that sizes
their grid, and read each sequence's real length from ``seq_lens`` on the device.

If capture fails (an op that synchronises, e.g. a reference implementation doing ``.item()``), one
warning says why and every step runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
import math
import time

import torch

from turnout.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly: launch overhead is amortised there


def graph_buckets(max_num_seqs: int, max_bucket: int = MAX_GRAPH_BATCH) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to min(max_num_seqs, max_bucket),
    which is always the last bucket."""
    top = max(1, min(int(max_num_seqs), int(max_bucket)))
    sizes = {b for b in (1, 2, 4) if b < top} | set(range(8, top, 8)) | {top}
    return sorted(sizes)


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``n`` lanes; None when ``n`` is larger than every bucket."""
    if n < 1:
        return None
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def is_graphable(num_tokens: int, num_seqs: int, num_sampled: int, max_query_len: int, table_width: int,
                 max_table_width: int, buckets: list[int]) -> bool:
    """A step replays a graph when it is pure decode (one token per sequence, every sequence samples),
    fits a bucket, and its block tables fit the static ones."""
    return (max_query_len == 1 and num_tokens == num_seqs == num_sampled and table_width <= max_table_width
            and bucket_for(num_seqs, buckets) is not None)


class DecodeGraphs:
    """One CUDA graph per bucket, one memory pool, static inputs; see the module docstring."""

    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int, device,
                 max_bucket: int = MAX_GRAPH_BATCH):
        self.model = model
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.buckets = graph_buckets(max_num_seqs, max_bucket)
        self.max_model_len = int(max_model_len)
        self.max_blocks = math.ceil(self.max_model_len / block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.disabled_reason: str | None = None
        self.capture_s = 0.0
        self.num_replays = 0
        self._filled = 0  # rows [0, _filled) may hold live values; rows beyond hold padding
        bs, dev = self.buckets[-1], self.device
        with torch.inference_mode():
            self.input_ids = torch.zeros(bs, dtype=torch.long, device=dev)
            self.positions = torch.zeros(bs, dtype=torch.long, device=dev)
            self.slot_mapping = torch.full((bs,), -1, dtype=torch.long, device=dev)
            self.block_tables = torch.zeros(bs, self.max_blocks, dtype=torch.int32, device=dev)
            self.seq_lens = torch.ones(bs, dtype=torch.int32, device=dev)
            self.query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=dev)
        self.logits: torch.Tensor | None = None  # [max_bs, V] f32, made by the first warm-up (V as computed)

    @property
    def enabled(self) -> bool:
        return bool(self.graphs) and self.disabled_reason is None

    def stats(self) -> dict:
        return {"enabled": self.enabled, "buckets": sorted(self.graphs), "capture_s": round(self.capture_s, 3),
                "replays": self.num_replays, "disabled_reason": self.disabled_reason}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
                                 seq_lens=self.seq_lens[:b], query_start_loc=self.query_start_loc[:b + 1],
                                 max_query_len=1, max_seq_len=self.max_model_len)

    def _forward(self, b: int) -> None:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b))
        if self.logits is None:  # the largest bucket's eager warm-up, before any capture
            logits = self.model.compute_logits(hidden)  # [b, V]
            self.logits = torch.empty((self.buckets[-1], logits.shape[-1]), dtype=logits.dtype, device=logits.device)
            self.logits[:b].copy_(logits)
        else:  # straight into the shared buffer: one kernel casts and stores
            self.model.compute_logits(hidden, out=self.logits[:b])

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
                # Eager warm-up on the capture stream: first op calls settle the op table, Triton
                # compiles and autotunes for this shape, cuBLAS picks its algorithms. None of that
                # may happen inside a capture.
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    self._forward(b)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(stream):
                    graph.capture_begin(pool=pool)
                    error = None
                    try:
                        self._forward(b)
                    except Exception as e:  # noqa: BLE001 - reported below, with the end-capture error
                        error = e
                    try:
                        graph.capture_end()
                    except Exception as e:  # noqa: BLE001
                        error = error or e
                if error is not None:
                    raise _CaptureError(b, error)
                self.graphs[b] = graph
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 - any failure means: run eagerly
            self._give_up(e)
            return False
        finally:
            self.capture_s = time.perf_counter() - t0
        logger.info("CUDA graphs: captured %d decode batch sizes (%s) in %.1fs", len(self.graphs),
                    _describe(self.buckets), self.capture_s)
        return True

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
        n = int(meta.seq_lens.shape[0])
        return self.enabled and is_graphable(int(meta.slot_mapping.shape[0]), n, num_sampled, meta.max_query_len,
                                             int(meta.block_tables.shape[1]), self.max_blocks, self.buckets)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions and meta on the host (pinned): one async copy each into the static
        buffers, then replay. input_ids may also be on the device (a lookahead step's inputs: the
        previous step's sampled tokens). Returns logits [n, vocab] f32, a view valid until the next replay."""
        n = int(input_ids.shape[0])
        b = bucket_for(n, self.buckets)
        width = int(meta.block_tables.shape[1])
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # Columns beyond `width` keep stale (valid) block ids: kernels read only ceil(seq_len / block_size).
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if n < self._filled:  # re-pad the lanes the last batch used and this one does not
            self.slot_mapping[n:self._filled].fill_(-1)
            self.seq_lens[n:self._filled].fill_(1)
        self._filled = n
        self.graphs[b].replay()
        self.num_replays += 1
        return self.logits[:n]


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
    graphs = DecodeGraphs(runner.model, runner.kv_caches, config.max_num_seqs, runner.max_model_len,
                          runner.block_size, runner.device)
    graphs.capture()
    return graphs
