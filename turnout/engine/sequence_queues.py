"""Where each live sequence is, and how it moves: the scheduler's waiting / running / swapped queues, the
sequence ids, admission (``add``), preemption, the endings (``finish``, ``abort``) and the counters. No torch.

Separate from the step policy (engine/scheduler.py, which subclasses this): these moves keep the queues,
the blocks and each sequence's status consistent whatever the policy decides to run.

Preemption, by recompute: the sequence's blocks are freed, ``num_computed_tokens`` = 0, its generated
tokens are kept (it re-prefills prompt + output, partly from the prefix cache), and it goes to the front of
the waiting queue. By swap (``Preemption``: mode "swap", or "auto" where the copies cost less than the
recompute): its computed blocks are copied to the host swap pool (kv/tiers.py) and it waits in ``swapped``
(oldest arrival first) with everything else as it was; a full pool means recompute (counted).

Sequence ids: fork children get ids from ``new_seq_id()``; the engine should take its ids from the same
method so that they never collide (``add`` rejects an id already in use).
"""

from __future__ import annotations

import itertools
from collections import deque

from turnout.engine.sequence import Sequence, SequenceStatus
from turnout.kv.block_manager import BlockManager
from turnout.kv.preemption import Preemption


class SequenceQueues:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 preemption: Preemption | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError(f"Scheduler: max_num_seqs ({max_num_seqs}), max_num_batched_tokens "
                             f"({max_num_batched_tokens}) and max_model_len ({max_model_len}) must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preemption = preemption or Preemption()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.swapped: list[Sequence] = []  # preempted by swap, oldest arrival first
        self._next_seq_id = 0
        self._live_ids: set[int] = set()
        # counters
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of those, by swap (the rest by recompute)
        self.num_swap_pool_full = 0  # swap chosen but the host pool was full: recomputed instead
        self.num_prefill_tokens_computed = 0  # tokens computed for sequences not yet decoding (prompt, recompute)
        self.num_decode_tokens_computed = 0
        self.num_prefix_cached_tokens = 0  # tokens found in the prefix cache at first schedules
        self.num_steps = 0

    # ---- ids and admission ----------------------------------------------------------------------
    def new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING, nothing computed). ValueError if it can never run: an id
        in use, a prompt over max_model_len, n over max_num_seqs, or more blocks than exist for its
        longest possible length (prompt + max_tokens, capped by max_model_len)."""
        bm = self.block_manager
        if seq.seq_id in self._live_ids:
            raise ValueError(f"sequence id {seq.seq_id} is already in use (take ids from Scheduler.new_seq_id())")
        if seq.status != SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"add: sequence {seq.seq_id} must be new (WAITING, nothing computed), got {seq!r}")
        if seq.num_tokens > self.max_model_len:
            raise ValueError(f"request {seq.request_id!r}: {seq.num_tokens} prompt tokens exceed max_model_len "
                             f"({self.max_model_len})")
        if seq.n > self.max_num_seqs:
            raise ValueError(f"request {seq.request_id!r}: n = {seq.n} exceeds max_num_seqs ({self.max_num_seqs})")
        max_tokens = seq.max_tokens
        longest = self.max_model_len if max_tokens is None else min(seq.num_tokens + max_tokens, self.max_model_len)
        need = bm.max_blocks_per_seq(longest, self.max_num_batched_tokens)  # a sliding window bounds it
        if need > bm.capacity:
            raise ValueError(
                f"request {seq.request_id!r}: up to {longest} tokens ({seq.num_tokens} prompt"
                f"{'' if max_tokens is None else f' + {max_tokens} max_tokens'}, max_model_len {self.max_model_len}) "
                f"need {need} KV blocks of {bm.block_size} tokens, but the cache has only {bm.capacity}")
        self._live_ids.add(seq.seq_id)
        self._next_seq_id = max(self._next_seq_id, seq.seq_id + 1)
        self.waiting.append(seq)

    # ---- preemption -----------------------------------------------------------------------------
    def _preempt(self, seq: Sequence, undo_copies=()) -> None:
        """Take a running sequence out, by swap or by recompute (the module docstring). ``undo_copies``:
        the copy-on-write pairs queued for it earlier in this step, dropped with it: a swap reads their
        sources, as their destinations hold nothing yet."""
        bm = self.block_manager
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.preemption.mode != "recompute" and seq.num_computed_tokens > 0 and \
                self.preemption.swap_pays(bm.blocks_for(seq.num_computed_tokens), seq.num_computed_tokens):
            if bm.swap_out(seq, list(undo_copies)):
                seq.status = SequenceStatus.SWAPPED
                key = (seq.arrival_time, seq.seq_id)
                at = next((i for i, s in enumerate(self.swapped) if (s.arrival_time, s.seq_id) > key), len(self.swapped))
                self.swapped.insert(at, seq)
                self.num_swap_preemptions += 1
                return
            self.num_swap_pool_full += 1
        bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    # ---- endings --------------------------------------------------------------------------------
    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """The engine ends a sequence (stop or length): frees its blocks. Idempotent."""
        if not status.is_finished:
            raise ValueError(f"finish: {status} is not a finished status")
        if seq.status.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.drop_swapped(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        self._live_ids.discard(seq.seq_id)

    def abort(self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED) -> list[Sequence]:
        """End every sequence of the request, waiting or running, with ``status`` (aborted, or failed by
        a fault); frees their blocks. Returns them."""
        seqs = [s for s in itertools.chain(self.running, self.waiting, self.swapped) if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, status)
        return seqs

    # ---- state ----------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> dict[str, float]:
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preemptions": self.num_preemptions,
            "num_swapped": len(self.swapped),
            "num_swap_preemptions": self.num_swap_preemptions,
            "num_recompute_preemptions": self.num_preemptions - self.num_swap_preemptions,
            "num_swap_pool_full": self.num_swap_pool_full,
            "num_prefill_tokens_computed": self.num_prefill_tokens_computed,
            "num_decode_tokens_computed": self.num_decode_tokens_computed,
            "num_prefix_cached_tokens": self.num_prefix_cached_tokens,
            **{f"kv_{k}": v for k, v in self.block_manager.stats().items()},
        }
