"""Drafting from the target's hidden states: the "mtp" method (the checkpoint's multi-token-prediction layer,
turnout/models/mtp.py) and "eagle3" (a separate EAGLE-3 head, turnout/models/eagle3.py). One proposer serves
both; the head says how a position's input is made and how its logits become target token ids.

A draft layer reads, per position t, the pair (the target's hidden state at t, the token at t + 1) and predicts
the token at t + 2; it attends over the pairs of earlier positions through a paged cache of its own
(``DraftKV``: one layer, its own block lists). The target's hidden states come from the rank's ``HiddenCapture``
(worker/hidden_capture.py), recorded by each forward. When the engine asks (before a step), a decoding sequence
of n tokens has the target's hidden states of positions < n - 1, so the proposer

1. computes the pairs of positions [done, n - 1) the draft's cache lacks, in one packed forward for every
   sequence (a prefill chunk, then one position per step: the last accepted ones); the last of them, position
   n - 2 with the token x_{n-1}, gives the first draft (greedy over the head's logits);
2. chains: draft j + 1 is the layer's output at position n - 2 + j, fed its own output stream (before its final
   norm) as the hidden state and draft j as the token, as vLLM chains one MTP layer or an EAGLE head.

Position n - 2 is computed again the next time (its pair's output is not kept), and the chained positions'
cache entries are overwritten once the real pairs are known. The drafts are token ids like any proposer's: the
target verifies them in its one multi-token step (worker/step.py), so output is exact whatever the head drafts.

Where the target did not compute positions (a prefix-cache hit, or positions computed before a preemption's
recompute), the draft's context restarts at the first position with a hidden state: drafts stay exact, but
attend over less. A sequence whose blocks do not fit the draft's pool is decoded without drafts that step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from turnout.engine.sequence import Sequence
from turnout.kv.spec import CacheLayout
from turnout.layers.attention import AttentionMetadata
from turnout.worker.kv_sizing import allocate_caches, dtype_name

logger = logging.getLogger(__name__)


class DraftHead(Protocol):
    def kv_spec(self, cache_dtype: str): ...

    def first_hidden(self, captured: torch.Tensor) -> torch.Tensor:
        """The captured target rows [T, W] -> the layer's hidden input [T, H]."""

    def forward(self, input_ids, positions, hidden, kv_cache, meta) -> torch.Tensor:
        """-> the layer's output stream [T, H] (before its final norm: the next chained step's hidden)."""

    def draft(self, stream: torch.Tensor) -> torch.Tensor:
        """[B, H] -> the greedy draft per row, as target token ids [B]."""


def attention_kv_spec(attn, cache_dtype: str):
    """The cache spec of an attention block (MLA declares its own; a DecoderAttention's Attention does)."""
    return next(m.kv_spec(cache_dtype) for m in attn.modules() if callable(getattr(m, "kv_spec", None)))


class DraftKV:
    """The draft layer's paged cache: ``num_blocks`` blocks and a free list; a sequence holds a block list."""

    def __init__(self, spec, num_blocks: int, block_size: int, device):
        self.cache = allocate_caches(CacheLayout((spec,)), num_blocks, block_size, 0, device)[0]
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))

    def grow(self, blocks: list[int], slots: int) -> bool:
        """``blocks`` extended to hold ``slots`` slots; False (unchanged) where the pool has too few."""
        need = -(-slots // self.block_size) - len(blocks)
        if need > len(self.free):
            return False
        blocks.extend(self.free.pop() for _ in range(max(need, 0)))
        return True

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)
        blocks.clear()


@dataclass
class _Lane:
    """A sequence's draft context: the cache holds the pairs of positions [start, done), position t at slot
    t - start of ``blocks``."""

    seq: Sequence
    start: int = 0
    done: int = 0
    blocks: list[int] = field(default_factory=list)


class HiddenStateProposer:
    """A DraftProposer (engine/drafts.py) over a ``DraftHead`` and the rank's ``HiddenCapture``."""

    def __init__(self, head: DraftHead, capture, k: int, max_model_len: int, num_blocks: int, block_size: int,
                 cache_dtype: torch.dtype, device, max_batch: int | None = None):
        self.head, self.capture, self.k, self.max_model_len = head, capture, k, max_model_len
        self.max_batch, self.device = max_batch, device
        self.kv = DraftKV(head.kv_spec(dtype_name(cache_dtype)), num_blocks, block_size, device)
        self._lanes: dict[int, _Lane] = {}

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        self._sweep()
        work = []  # (lane, end, room, captured rows [done - base: end - base])
        for seq in seqs:
            room = min(self.k, self.max_model_len - seq.num_tokens)
            end = seq.num_tokens - 1  # pairs (h_t, x_{t+1}) are known for t < end
            held = self.capture.store.get(seq.seq_id)
            if room < 1 or end < 1 or held is None or held.end < end or held.base > end - 1:
                continue
            lane = self._lanes.get(seq.seq_id)
            if lane is None or lane.seq is not seq:
                if lane is not None:
                    self.kv.release(lane.blocks)
                lane = self._lanes[seq.seq_id] = _Lane(seq)
            if not held.base <= lane.done <= end - 1:  # no hidden states before base: the context restarts there
                lane.start = lane.done = held.base
            if not self.kv.grow(lane.blocks, end + room - 1 - lane.start):
                continue
            work.append((lane, end, room, held.rows[lane.done - held.base:end - held.base]))
        if not work:
            return {}
        drafts = self._draft(work)
        for lane, end, _, _ in work:
            lane.done = end - 1  # the last pair is computed again next time: its output is the first draft's input
            self.capture.release(lane.seq.seq_id, end - 1)
        return drafts

    def _draft(self, work) -> dict[int, list[int]]:
        ids, pos, rows, entries = [], [], [], []
        for lane, end, _, captured in work:
            ids.extend(lane.seq.token_ids[lane.done + 1:end + 1])
            pos.extend(range(lane.done, end))
            rows.append(captured)
            entries.append((lane, lane.done, end - lane.done))
        hidden = self.head.first_hidden(torch.cat(rows).to(self.device))
        stream = self.head.forward(self._t(ids), self._t(pos), hidden, self.kv.cache, self._meta(entries))
        last = torch.tensor([sum(n for _, _, n in entries[:i + 1]) - 1 for i in range(len(entries))],
                            device=self.device)
        stream = stream.index_select(0, last)  # [B, H]: each sequence's position n - 2
        tokens = self.head.draft(stream)
        out = {lane.seq.seq_id: [t] for (lane, _, _, _), t in zip(work, tokens.tolist())}
        live = list(range(len(work)))
        for j in range(1, self.k):
            live = [i for i in live if work[i][2] > j]
            if not live:
                break
            idx = torch.tensor(live, device=self.device)
            stream, tokens = stream.index_select(0, idx), tokens.index_select(0, idx)
            at = [work[i][1] - 1 + j for i in live]  # position n - 2 + j
            entries = [(work[i][0], p, 1) for i, p in zip(live, at)]
            stream = self.head.forward(tokens, self._t(at), stream, self.kv.cache, self._meta(entries))
            tokens = self.head.draft(stream)
            for i, t in zip(live, tokens.tolist()):
                out[work[i][0].seq.seq_id].append(t)
        return out

    def _t(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _meta(self, entries: list[tuple[_Lane, int, int]]) -> AttentionMetadata:
        """Per (lane, first position, count): those positions' slots, attending over the lane's context."""
        bs = self.kv.block_size
        slots, qsl, lens = [], [0], []
        for lane, first, n in entries:
            for p in range(first - lane.start, first - lane.start + n):
                slots.append(lane.blocks[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            lens.append(first - lane.start + n)
        width = max(len(lane.blocks) for lane, _, _ in entries)
        tables = [lane.blocks + [0] * (width - len(lane.blocks)) for lane, _, _ in entries]
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(n for _, _, n in entries), max_seq_len=max(lens), seq_lens_host=tuple(lens),
            query_start_loc_host=tuple(qsl))

    def _sweep(self) -> None:
        """Free the blocks of the sequences that ended."""
        for seq_id in [i for i, lane in self._lanes.items() if lane.seq.status.is_finished]:
            self.kv.release(self._lanes.pop(seq_id).blocks)


class MTPHead:
    """The checkpoint's first multi-token-prediction layer as a DraftHead (turnout/models/mtp.py); it reads the
    target's stream before the final norm, and chains itself for k > 1."""

    def __init__(self, model):
        self.layer = model.mtp.layers[0]

    def kv_spec(self, cache_dtype: str):
        return attention_kv_spec(self.layer.block.self_attn, cache_dtype)

    def first_hidden(self, captured: torch.Tensor) -> torch.Tensor:
        return captured

    def forward(self, input_ids, positions, hidden, kv_cache, meta) -> torch.Tensor:
        return self.layer(input_ids, positions, hidden, kv_cache, meta)

    def draft(self, stream: torch.Tensor) -> torch.Tensor:
        return self.layer.compute_logits(stream).argmax(-1)


def build_hidden_state_proposer(spec, runner, tensor_parallel_size: int) -> HiddenStateProposer:
    """The "mtp" / "eagle3" proposer over the driver rank's ``runner`` (its model, its ``hidden_capture``);
    what the model cannot serve is a ValueError naming the field."""
    method, model = spec.method, runner.model
    if tensor_parallel_size != 1:
        raise ValueError(f"speculative_config.method: {method!r} drafts on the driver rank alone; it needs "
                         f"tensor_parallel_size 1 (got {tensor_parallel_size})")
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("layers", "norm", "embed_tokens")):
        raise ValueError(f"speculative_config.method: {method!r} reads the target's hidden states, which "
                         f"{type(model).__name__} does not expose (a turnout decoder family is needed)")
    num_layers = len(inner.layers)
    if method == "mtp":
        if getattr(model, "mtp", None) is None:
            n = getattr(runner.hf_config, "num_nextn_predict_layers", None)
            raise ValueError(f"speculative_config.method: 'mtp' drafts with the checkpoint's multi-token-prediction "
                             f"layers; {type(model).__name__} has none here (num_nextn_predict_layers {n!r})")
        head, points = MTPHead(model), (num_layers,)
    else:
        from turnout.loader.eagle3 import load_eagle3_head

        head = load_eagle3_head(spec.model, model, runner.ops, runner.device, runner.dtype)
        points = head.aux_layers
    runner.hidden_capture.install(points)
    k, bs = spec.num_speculative_tokens, runner.block_size
    # the target's blocks (one layer's worth of them) plus each sequence's drafts and a partial block
    blocks = runner.num_blocks + runner.max_num_seqs * (-(-(k + 1) // bs) + 1)
    logger.info("speculative %s: k=%d, the draft layer's cache %d blocks, hidden states from layer(s) %s", method,
                k, blocks, ", ".join(map(str, points)))
    return HiddenStateProposer(head, runner.hidden_capture, k, runner.max_model_len, blocks, bs, runner.kv_dtype,
                               runner.device, max_batch=spec.disable_by_batch_size)
