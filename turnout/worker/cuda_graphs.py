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

``positions``, ``slot_mapping``, ``seq_lens`` and ``block_tables`` are views of one int32 buffer, so a step's
inputs go up in one copy: the host fills a pinned buffer of the same layout (two, used in turn), a side
stream copies it to a device staging buffer (two) while the previous step still runs, and the step
itself makes one device-to-device copy before the replay (before, four host-to-device copies waited in
line, ~3 µs each of the step's GPU timeline). The copy covers the 1-D inputs of every row and the block-table rows of the
live lanes; other block-table rows keep earlier (valid) block ids.

Padding lanes (rows ``n .. b-1`` of a batch of ``n`` replayed in bucket ``b``) write nowhere (slot -1) and
attend to one token of block 0 (seq_len 1, a valid block id): finite garbage that nobody reads. The
invariant: every row at or beyond the last live batch size holds padding values; each pinned buffer
re-pads the rows it held live before and does not now, and its copy carries them.

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

# Larger decode batches run eagerly: launch overhead is amortised there. 1024 is the largest default
# max_num_seqs (turnout/engine/concurrency.py), so a default engine replays every decode batch.
MAX_GRAPH_BATCH = 1024
# Up to here every multiple of 8 is captured; above, every multiple of 32 (a padded lane costs a 32nd of a
# step's batch at most there, and the capture count stays bounded: 59 graphs for 1024, 43 for 512)
FINE_GRAPH_BATCH = 256


def graph_buckets(max_num_seqs: int, max_bucket: int = MAX_GRAPH_BATCH) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, every multiple of 8 up to 256, then every multiple of 32, up to
    min(max_num_seqs, max_bucket), which is always the last bucket."""
    top = max(1, min(int(max_num_seqs), int(max_bucket)))
    sizes = {b for b in (1, 2, 4) if b < top} | set(range(8, min(top, FINE_GRAPH_BATCH + 1), 8))
    sizes |= set(range(FINE_GRAPH_BATCH + 32, top, 32)) | {top}
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
                 max_bucket: int = MAX_GRAPH_BATCH, upload_stream=None):
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
        bs, dev = self.buckets[-1], self.device
        cuda = dev.type == "cuda"
        self._upload = upload_stream if cuda else None
        with torch.inference_mode():
            self.input_ids = torch.zeros(bs, dtype=torch.long, device=dev)
            self._inputs = torch.empty(self._words(bs), dtype=torch.int32, device=dev)
            self.positions, self.slot_mapping, self.seq_lens, self.block_tables = self._views(self._inputs)
            self.query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=dev)
            # pinned host buffers and device staging buffers, two of each, used in turn
            self._host = [torch.empty(self._words(bs), dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
            self._staging = [torch.empty_like(self._inputs) for _ in range(2)] if self._upload is not None else []
            for buf in self._host:
                self._pad(self._views(buf), 0)
            self._inputs.copy_(self._host[0])
        self._host_filled = [0, 0]  # rows [0, k) of pinned buffer i may hold live values; rows beyond, padding
        self._uploaded = [torch.cuda.Event() for _ in range(2)] if cuda else []  # staging i written
        self._consumed = [torch.cuda.Event() for _ in range(2)] if cuda else []  # staging i read
        self._turn = 0
        self.logits: torch.Tensor | None = None  # [max_bs, V] f32, made by the first warm-up (V as computed)

    def _words(self, rows: int) -> int:
        """int32 words of the inputs buffer up to the end of block-table row ``rows``: positions and slots
        (int64, all rows), seq_lens (all rows), then the block tables row by row."""
        return 5 * self.buckets[-1] + rows * self.max_blocks

    def _views(self, buf: torch.Tensor):
        """(positions i64 [bs], slot_mapping i64 [bs], seq_lens i32 [bs], block_tables i32 [bs, max_blocks])."""
        bs = self.buckets[-1]
        return (buf[:2 * bs].view(torch.int64), buf[2 * bs:4 * bs].view(torch.int64), buf[4 * bs:5 * bs],
                buf[5 * bs:].view(bs, self.max_blocks))

    @staticmethod
    def _pad(views, start: int, stop: int | None = None) -> None:
        positions, slots, seq_lens, tables = views
        positions[start:stop] = 0
        slots[start:stop] = -1
        seq_lens[start:stop] = 1
        if start == 0 and stop is None:
            tables.zero_()

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
        i = self._turn
        self._turn ^= 1
        host = self._host[i]
        if self._uploaded:
            self._uploaded[i].synchronize()  # the copy that last read this pinned buffer (two steps ago) is done
        positions_h, slots_h, seq_lens_h, tables_h = views = self._views(host)
        positions_h[:n] = positions
        slots_h[:n] = meta.slot_mapping
        seq_lens_h[:n] = meta.seq_lens
        # Columns beyond `width` keep stale (valid) block ids: kernels read only ceil(seq_len / block_size).
        tables_h[:n, :width] = meta.block_tables
        if n < self._host_filled[i]:  # re-pad the lanes this buffer held live before and does not now
            self._pad(views, n, self._host_filled[i])
        self._host_filled[i] = n
        words = self._words(n)
        if self._upload is not None:  # up on the side stream, in one device-to-device copy here
            main = torch.cuda.current_stream(self.device)
            staging = self._staging[i]
            with torch.cuda.stream(self._upload):
                self._upload.wait_event(self._consumed[i])  # the step that last read staging i has copied it
                staging[:words].copy_(host[:words], non_blocking=True)
                self._uploaded[i].record(self._upload)
            main.wait_event(self._uploaded[i])
            self._inputs[:words].copy_(staging[:words], non_blocking=True)
            self._consumed[i].record(main)
        else:
            self._inputs[:words].copy_(host[:words], non_blocking=True)
            if self._uploaded:
                self._uploaded[i].record()
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
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
                          runner.block_size, runner.device, upload_stream=runner._upload)
    graphs.capture()
    return graphs
