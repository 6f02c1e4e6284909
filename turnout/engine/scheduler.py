"""Continuous batching with chunked prefill, prefix caching, n > 1 forks and preemption. No torch.

One engine step::

    out = scheduler.schedule()              # what to compute, block copies, forks, preemptions
    ... run out.copy_on_write, then the forward over out.scheduled; sample one token for every
        scheduled entry with sample=True, and one for every fork (child, from its parent's logits row)
    scheduler.postprocess(out)              # KV bookkeeping: num_computed_tokens, prefix-cache blocks
    seq.append_token(t)                     # for each sampled token (parents and fork children);
                                            # before or after postprocess: the two do not interact
    scheduler.finish(seq, status)           # for each sequence that stopped; AFTER postprocess, so the
                                            # blocks computed in its last step reach the prefix cache

Policy, per step, within ``max_num_batched_tokens`` tokens:

1. running sequences with one token to compute (decodes), oldest first: never starved by prompts;
2. running sequences with more (a chunked prefill in progress, or a recompute), oldest first, each
   chunked to the remaining budget;
Fairness: while more than one request has work, one request runs at most ``cap`` of its sequences in
a step, where ``cap = max(fair_share_seqs, the most sequences any other request has)``: a request with
n = 128 samples cannot make every step 128 rows long (on a CPU, 1.5 s) while a one-sample request waits
behind it, and two large requests still run at full width. The sequences of a capped request take
turns: those with the fewest output tokens go first. The preemption victim is taken from a request over
its cap (counting its waiting ones) first.

3. waiting sequences, first come first served (a preempted one goes back to the FRONT), each chunked to
   the remaining budget, while ``max_num_seqs`` and free blocks allow; the head of the queue that does
   not fit stops admission (no overtaking). Nothing is admitted in a step that preempted.

When a running sequence needs a block and none is free, the NEWEST running sequence (latest arrival,
then highest seq_id; possibly the one asking) is preempted. By recompute: its blocks are freed,
``num_computed_tokens`` = 0, its generated tokens are kept (it re-prefills prompt + output, partly from
the prefix cache), and it goes to the front of the waiting queue. By swap (``Preemption``: mode "swap", or
"auto" where the copies cost less than the recompute): its computed blocks are copied to the host swap
pool (kv/tiers.py) and it waits in ``swapped`` with everything else as it was; a full pool means
recompute (counted). If it was already scheduled in this step it is taken out of the step again. Then
the allocation is retried.

Swapped sequences come back before any waiting one is admitted (oldest arrival first, in a step that
preempted nothing): fresh device blocks, their host blocks queued to be copied in before the step's
forward (``SchedulerOutput.swap_in``), and they are scheduled in that same step where they stopped.

A request with ``n > 1`` is one sequence until the chunk that completes its prompt is scheduled; then
``n - 1`` children are forked, sharing all its blocks. They are listed in ``SchedulerOutput.forks``: each
samples its first token from its parent's logits row of this step. Each child is then an independent
running sequence; the first write into the shared, partly filled last block copies it
(``copy_on_write``), so a request of n samples makes n - 1 copies (the last writer keeps the original).

Sequence ids: children get ids from ``new_seq_id()``; the engine should take its ids from the same
method so that they never collide (``add`` rejects an id already in use).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from turnout.engine.sequence import Sequence, SequenceStatus
from turnout.kv.block_manager import BlockManager
from turnout.kv.preemption import Preemption


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # = seq.num_computed_tokens before the step
    num_tokens: int  # compute seq.token_ids[start:start + num_tokens] this step
    sample: bool  # the chunk reaches the end of the sequence: sample from its last token's logits
    # proposed tokens computed after the chunk in the same forward (a multi-token step): the rank keeps the
    # ones its own draws confirm (worker/step.py); slots are reserved for all of them
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        """False for a decode: the one token sampled last step (prompt done, not a recompute)."""
        return self.num_tokens > 1 or self.start < self.seq.num_prompt_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # (index into `scheduled` of the parent, the new child): the child samples its first token from the
    # parent's logits row; the child is already running and holds references on the parent's blocks
    forks: list[tuple[int, Sequence]] = field(default_factory=list)
    copy_on_write: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies, before the forward
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    # host tier copies (kv/tiers.py gives the order): (device, host) before anything else of the step,
    # (host, device) after copy_on_write and before the forward
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 fair_share_seqs: int | None = None, preemption: Preemption | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError(f"Scheduler: max_num_seqs ({max_num_seqs}), max_num_batched_tokens "
                             f"({max_num_batched_tokens}) and max_model_len ({max_model_len}) must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.fair_share_seqs = fair_share_seqs  # None: no per-request cap (see the module docstring)
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

    # ---- the step -------------------------------------------------------------------------------
    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """``drafts``: seq_id -> tokens proposed to follow a decoding sequence (engine/drafts.py); each is
        verified in this step where the budget, the cache and the sequence's limits leave room."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        entries: dict[int, ScheduledSeq] = {}  # seq_id -> entry, in scheduling order
        copies: dict[int, list[tuple[int, int]]] = {}
        preempted: list[Sequence] = []

        caps, demand = self._fair_caps()

        def preempt_newest() -> Sequence:
            nonlocal budget
            # a request holding more sequences than its share gives them up before anyone else
            victim = max(self.running, key=lambda s: (caps is not None and caps[s.request_id] < demand[s.request_id],
                                                      s.arrival_time, s.seq_id))
            entry = entries.pop(victim.seq_id, None)
            undo = ()
            if entry is not None:  # scheduled earlier in this step: undo
                budget += entry.num_tokens + len(entry.draft_token_ids)
                undo = copies.pop(victim.seq_id, ())
            self._preempt(victim, undo)
            preempted.append(victim)
            return victim

        # 1 + 2: running sequences, decodes first
        decodes, prefills = [], []
        for seq in self.running:
            todo = seq.num_tokens - seq.num_computed_tokens
            if todo == 1:
                decodes.append(seq)
            elif todo > 1:
                prefills.append(seq)
            else:
                raise RuntimeError(f"sequence {seq.seq_id} has nothing to compute: after a step that sampled "
                                   f"for it, the engine must append the token or finish the sequence")
        if caps is not None and any(demand[r] > caps[r] for r in demand):
            decodes, prefills = self._take_turns(decodes, prefills, caps)
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted in this step
                continue
            start = seq.num_computed_tokens
            num_new = min(seq.num_tokens - start, budget)
            draft = self._drafts_that_fit(seq, (drafts or {}).get(seq.seq_id), budget) if num_new == 1 else []
            if draft:  # slots for the drafts too; no preemption for them: without room, the step has none
                if bm.can_append(seq, 1 + len(draft)):
                    copies_for = bm.append_slots(seq, 1 + len(draft))
                    if copies_for:
                        copies[seq.seq_id] = copies_for
                    entries[seq.seq_id] = ScheduledSeq(seq, start, 1, True, list(draft))
                    budget -= 1 + len(draft)
                    continue
            while not bm.can_append(seq, num_new):
                if len(self.running) == 1:
                    raise RuntimeError(f"sequence {seq.seq_id} ({seq.num_tokens} tokens) cannot grow: the KV cache "
                                       f"has {bm.num_blocks} blocks of {bm.block_size} tokens, all free to it")
                if preempt_newest() is seq:
                    break
            else:
                pairs = bm.append_slots(seq, num_new)
                if pairs:
                    copies[seq.seq_id] = pairs
                entries[seq.seq_id] = ScheduledSeq(seq, start, num_new, start + num_new == seq.num_tokens)
                budget -= num_new

        # swapped sequences come back first, oldest arrival first, where they stopped
        if not preempted:
            while self.swapped and budget > 0:
                seq = self.swapped[0]
                if sum(s.n for s in self.running) + 1 > self.max_num_seqs:
                    break
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if not bm.can_swap_in(seq, num_new):
                    break
                self.swapped.pop(0)
                bm.swap_in(seq)
                pairs = bm.append_slots(seq, num_new)
                if pairs:
                    copies[seq.seq_id] = pairs
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                start = seq.num_computed_tokens
                entries[seq.seq_id] = ScheduledSeq(seq, start, num_new, start + num_new == seq.num_tokens)
                budget -= num_new

        # 3: waiting sequences, FCFS (none while a swapped one waits to come back)
        if not preempted and not self.swapped:
            seats = sum(s.n for s in self.running)  # pending forks hold their seats
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                if seats + seq.n > self.max_num_seqs:
                    break
                cached = bm.match_prefix(seq)
                num_cached = len(cached) * bm.block_size
                num_new = min(seq.num_tokens - num_cached, budget)
                if not bm.can_allocate(seq, num_new, cached):
                    break
                self.waiting.popleft()
                bm.allocate(seq, num_new, cached)
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = num_cached  # a recompute's hits are its own old blocks
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                seats += seq.n
                self.num_prefix_cached_tokens += num_cached
                entries[seq.seq_id] = ScheduledSeq(seq, num_cached, num_new, num_cached + num_new == seq.num_tokens)
                budget -= num_new

        out = SchedulerOutput(scheduled=list(entries.values()), preempted=preempted)
        out.swap_out, out.swap_in = bm.take_transfers()
        for pairs in copies.values():
            out.copy_on_write.extend(pairs)
        for i, entry in enumerate(out.scheduled):
            out.num_batched_tokens += entry.num_tokens + len(entry.draft_token_ids)
            if entry.is_prefill:
                self.num_prefill_tokens_computed += entry.num_tokens
            else:
                self.num_decode_tokens_computed += entry.num_tokens
            if entry.sample and entry.seq.n > 1:
                out.forks.extend((i, child) for child in self._fork(entry))
        self.num_steps += 1
        return out

    def _fair_caps(self) -> tuple[dict[str, int] | None, dict[str, int]]:
        """(request_id -> the most sequences it may run this step, or None when nothing is capped: no
        fair share set, or fewer than two requests with work; request_id -> its sequences with work)."""
        if self.fair_share_seqs is None:
            return None, {}
        demand: dict[str, int] = {}
        for seq in self.running:
            demand[seq.request_id] = demand.get(seq.request_id, 0) + 1
        for seq in self.waiting:
            demand[seq.request_id] = demand.get(seq.request_id, 0) + seq.n
        for seq in self.swapped:
            demand[seq.request_id] = demand.get(seq.request_id, 0) + 1
        if len(demand) < 2:
            return None, demand
        first_id, first = max(demand.items(), key=lambda kv: kv[1])
        second = max(d for r, d in demand.items() if r != first_id)
        # the largest request is capped by the second largest; every other one by the largest
        return {r: max(self.fair_share_seqs, second if r == first_id else first) for r in demand}, demand

    @staticmethod
    def _take_turns(decodes: list[Sequence], prefills: list[Sequence], caps: dict[str, int]
                    ) -> tuple[list[Sequence], list[Sequence]]:
        """Keep, per request, the ``caps[request]`` sequences furthest behind (fewest output tokens,
        then oldest id), so that a capped request's samples take turns; order otherwise unchanged."""
        by_req: dict[str, list[Sequence]] = {}
        for seq in decodes + prefills:
            by_req.setdefault(seq.request_id, []).append(seq)
        chosen: set[int] = set()
        for rid, seqs in by_req.items():
            seqs.sort(key=lambda s: (s.num_output_tokens, s.seq_id))
            chosen.update(s.seq_id for s in seqs[: caps[rid]])
        return [s for s in decodes if s.seq_id in chosen], [s for s in prefills if s.seq_id in chosen]

    def schedule_lookahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The step after ``prev`` while ``prev``'s sampled tokens are still on the device: every
        sequence of ``prev`` decodes the token it is about to receive (not yet in ``token_ids``), at
        position ``num_computed_tokens``. Call after ``postprocess(prev)``.

        Only the steady decode state qualifies: ``prev`` sampled for every running sequence, nothing
        waits, no fork is pending, the batch fits the token budget and the free blocks (no preemption).
        Otherwise None, and the engine waits for the tokens and calls ``schedule`` as usual. The engine
        also decides per request (penalties, a last token) before asking."""
        if self.waiting or self.swapped or prev.forks or prev.preempted or len(prev.scheduled) != len(self.running):
            return None
        if len(prev.scheduled) > self.max_num_batched_tokens:
            return None
        bm = self.block_manager
        need = 0
        for entry in prev.scheduled:
            seq = entry.seq
            if (not entry.sample or seq.status != SequenceStatus.RUNNING or seq.n != 1
                    or seq.num_computed_tokens != seq.num_tokens or seq.num_tokens + 1 > self.max_model_len):
                return None
            need += bm.blocks_to_append(seq, 1)
        if need > bm.num_free_blocks:
            return None
        out = SchedulerOutput(scheduled=[], preempted=[])
        for entry in prev.scheduled:
            seq = entry.seq
            out.copy_on_write.extend(bm.append_slots(seq, 1))
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, 1, True))
        out.swap_out, out.swap_in = bm.take_transfers()  # evictions to the host tier only
        out.num_batched_tokens = len(out.scheduled)
        self.num_decode_tokens_computed += len(out.scheduled)
        self.num_steps += 1
        return out

    def _fork(self, entry: ScheduledSeq) -> list[Sequence]:
        parent = entry.seq
        children = []
        for index in range(parent.index + 1, parent.index + parent.n):
            child = parent.fork(self.new_seq_id(), index)
            # the child starts where the parent will be after this step; the shared blocks get their KV
            # from this step's forward
            child.num_computed_tokens = entry.start + entry.num_tokens
            self.block_manager.fork(parent, child)
            self._live_ids.add(child.seq_id)
            self.running.append(child)
            children.append(child)
        parent.n = 1
        return children

    def _preempt(self, seq: Sequence, undo_copies=()) -> None:
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

    def _drafts_that_fit(self, seq: Sequence, draft: list[int] | None, budget: int) -> list[int]:
        """The drafts of a decoding sequence that fit: the step's token budget, max_model_len and max_tokens
        (its one drawn token and the draft tokens all count as output)."""
        if not draft:
            return []
        room = min(budget - 1, self.max_model_len - seq.num_tokens - 1)
        if seq.max_tokens is not None:
            room = min(room, seq.max_tokens - seq.num_output_tokens - 1)
        return list(draft[:max(room, 0)])

    def accept_drafts(self, entry: ScheduledSeq, num_accepted: int) -> None:
        """After a multi-token step's draws were appended: the first ``num_accepted`` drafts were kept, so
        their KV is valid (the sequence's computed tokens grow by that much); the blocks reserved only for
        the rejected ones go back."""
        seq = entry.seq
        if seq.status != SequenceStatus.RUNNING:
            return
        seq.num_computed_tokens = entry.start + entry.num_tokens + num_accepted
        self.num_decode_tokens_computed += num_accepted
        self.block_manager.trim(seq, seq.num_tokens)
        self.block_manager.register_computed_blocks(seq)

    def postprocess(self, output: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens' KV is in the cache. Advances num_computed_tokens and
        registers newly full blocks in the prefix cache. Sequences finished or aborted since
        ``schedule`` are skipped."""
        for entry in output.scheduled:
            seq = entry.seq
            if seq.status != SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = entry.start + entry.num_tokens
            self.block_manager.register_computed_blocks(seq)

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
