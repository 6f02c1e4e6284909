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
3. waiting sequences, first come first served (a preempted one goes back to the FRONT), each chunked to
   the remaining budget, while ``max_num_seqs`` and free blocks allow; the head of the queue that does
   not fit stops admission (no overtaking). Nothing is admitted in a step that preempted.

When a running sequence needs a block and none is free, the NEWEST running sequence (latest arrival,
then highest seq_id; possibly the one asking) is preempted, one over its request's fair share
(engine/fair_share.py) first, by recompute or by swap (engine/sequence_queues.py). If it was already
scheduled in this step it is taken out of the step again. Then the allocation is retried.

Swapped sequences come back before any waiting one is admitted (oldest arrival first, in a step that
preempted nothing): fresh device blocks, their host blocks queued to be copied in before the step's
forward (``SchedulerOutput.swap_in``), and they are scheduled in that same step where they stopped.

A request with ``n > 1`` is one sequence until the chunk that completes its prompt is scheduled; then
``n - 1`` children are forked, sharing all its blocks. They are listed in ``SchedulerOutput.forks``: each
samples its first token from its parent's logits row of this step. Each child is then an independent
running sequence; the first write into the shared, partly filled last block copies it
(``copy_on_write``), so a request of n samples makes n - 1 copies (the last writer keeps the original).

A decoding sequence with drafts (engine/drafts.py) gets slots for them too where the budget, the cache
and its limits leave room (never by preempting); ``accept_drafts`` gives back the slots of the rejected ones.

The queues, ids, admission, preemption and endings are engine/sequence_queues.py (``SequenceQueues``, which
``Scheduler`` extends); the step's data engine/scheduler_output.py.
"""

from __future__ import annotations

from turnout.engine.fair_share import fair_caps, take_turns
from turnout.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from turnout.engine.sequence import Sequence, SequenceStatus
from turnout.engine.sequence_queues import SequenceQueues
from turnout.kv.block_manager import BlockManager
from turnout.kv.preemption import Preemption


class Scheduler(SequenceQueues):
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 fair_share_seqs: int | None = None, preemption: Preemption | None = None):
        super().__init__(block_manager, max_num_seqs, max_num_batched_tokens, max_model_len, preemption)
        self.fair_share_seqs = fair_share_seqs  # None: no per-request cap (engine/fair_share.py)

    # ---- the step -------------------------------------------------------------------------------
    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """``drafts``: seq_id -> tokens proposed to follow a decoding sequence (engine/drafts.py); each is
        verified in this step where the budget, the cache and the sequence's limits leave room."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        entries: dict[int, ScheduledSeq] = {}  # seq_id -> entry, in scheduling order
        copies: dict[int, list[tuple[int, int]]] = {}
        preempted: list[Sequence] = []

        caps, demand = fair_caps(self.fair_share_seqs, self.running, self.waiting, self.swapped)

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
            decodes, prefills = take_turns(decodes, prefills, caps)
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
