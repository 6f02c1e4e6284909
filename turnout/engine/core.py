"""The engine core: schedule -> execute -> update, one step at a time, with the lookahead protocol of
async scheduling (docs/architecture.md). It owns the scheduler and drives the model runner through a
narrow interface (``ModelExecutor``): each step goes to the rank as the typed contract of worker/step.py
(engine/step_inputs.py builds it) and its draws come back as lists of token ids per request; the core never
touches a tensor or the runner's internals.

Fault isolation: a step stage that can trace an exception to a request (building its inputs, its
sampling inputs, its logits processors, its grammar mask) reports it (``RequestFaults`` before the
forward, ``StepHandle.faults`` after it). The core fails that sequence's request only
(``SequenceStatus.FINISHED_ERROR``; the output processor reports ``finish_reason == "error"``), rebuilds
the step without it and goes on. Anything else raised by the runner (the forward, the sampler over the
whole batch, a device error) cannot be attributed and propagates: the engine is dead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from turnout.engine.core_outputs import CoreOutput, SampledToken
from turnout.engine.drafts import DraftCounts, DraftProposer, propose
from turnout.engine.scheduler import Scheduler
from turnout.engine.scheduler_output import SchedulerOutput
from turnout.engine.sequence import Sequence, SequenceStatus
from turnout.engine.step_inputs import StepInputs
from turnout.worker.step import RequestFaults

if TYPE_CHECKING:
    from turnout.worker.step import SchedulerOutput as StepContract
    from turnout.worker.step_sampling import StepHandle

logger = logging.getLogger(__name__)


class ModelExecutor(Protocol):
    """What the core needs of whatever runs the model (the driver rank's ModelRunner): one step of the
    contract (worker/step.py) in, a handle on its draws out (None where nothing draws)."""

    vocab_size: int
    num_blocks: int

    def execute(self, step: StepContract) -> StepHandle | None: ...

    def swap_out(self, pairs) -> None: ...

    def flush_swaps(self) -> None: ...

    def take_side_outputs(self) -> list: ...


@dataclass
class _Step:
    """A launched step: what was scheduled, the sequences that draw (in lane order), and the rank's
    handle on the draws (deferred: the forward runs, its draw waits for the grammars)."""

    out: SchedulerOutput
    lanes: list[Sequence]
    handle: StepHandle
    complete: bool = True  # every sampling entry of ``out`` has its row (no lane was dropped by a fault)
    lookahead: bool = False  # launched by _launch_lookahead


def _message(stage: str, e: BaseException) -> str:
    return f"{stage}: {type(e).__name__}: {e}"


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelExecutor, eos_ids: set[int], max_model_len: int,
                 async_scheduling: bool):
        self.scheduler = scheduler
        self.runner = runner
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.async_scheduling = async_scheduling
        self.inputs = StepInputs(eos_ids)  # the step contract, and which requests the rank keeps
        self.proposer: DraftProposer | None = None  # drafts for multi-token steps (engine/drafts.py)
        self.draft_counts = DraftCounts()
        self._inflight: _Step | None = None  # a launched lookahead step, read back by the next step()
        self._pending = CoreOutput()  # forks and failures since the last step() returned
        self.num_lookahead_steps = 0
        self.num_grammar_lookahead_steps = 0  # of those, steps with grammar lanes (sampled after the read)
        self.prompt_tokens_total = 0
        self.num_failed_requests = 0

    # ---- requests ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)  # ValueError if it can never fit

    def abort(self, request_id: str) -> None:
        self.inputs.forget(self.scheduler.abort(request_id))

    def fail(self, request_id: str, message: str) -> None:
        """End every sequence of a request with an error; the output processor is told by step()."""
        seqs = self.scheduler.abort(request_id, SequenceStatus.FINISHED_ERROR)
        if seqs:
            self.inputs.forget(seqs)
            logger.error("request %r failed: %s", request_id, message)
            self.num_failed_requests += 1
            self._pending.failed.append((request_id, message))

    def _fail_faults(self, faults: dict[int, BaseException], seqs: list[Sequence], stage: str) -> None:
        by_id = {s.seq_id: s for s in seqs}
        for seq_id, e in faults.items():
            seq = by_id.get(seq_id)
            if seq is None:  # a stage named a sequence it was not given: not attributable
                raise RuntimeError(f"{stage} reported a fault for unknown sequence {seq_id}") from e
            logger.debug("fault in %s for request %r", stage, seq.request_id, exc_info=e)
            self.fail(seq.request_id, _message(stage, e))

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> CoreOutput:
        """Launch (or take the launched) step, launch the lookahead after it where allowed, wait for its
        tokens and append them. The caller processes the tokens, then calls ``update``."""
        step = self._inflight
        self._inflight = None
        if step is None:
            out = self.scheduler.schedule(self._propose())
            if out.swap_out:  # device -> host first: they read the blocks before this step can write them
                self.runner.swap_out(out.swap_out)
            step = self._launch(out) if out.scheduled else None
        sampled: list[SampledToken] = []
        if step is not None:
            if self.async_scheduling:
                self._inflight = self._launch_lookahead(step)
            sampled = self._read(step)
            nxt = self._inflight
            if nxt is not None and nxt.handle.deferred:
                # the grammars have accepted this step's tokens: fill the masks and sample the lookahead,
                # whose forward the device has been running meanwhile
                ended = {s.seq_id for s in nxt.lanes if s.status.is_finished}
                self._inflight = self._started(nxt.out, nxt.lanes, nxt.handle.sample(ended), lookahead=True)
        result, self._pending = self._pending, CoreOutput()
        result.sampled = sampled
        return result

    def _propose(self) -> dict[int, list[int]] | None:
        if self.proposer is None:
            return None
        return propose(self.proposer, self.scheduler.running, self.runner.vocab_size)

    def update(self, ended: list[tuple[Sequence, SequenceStatus]], failed: list[str]) -> None:
        """After output processing: end the sequences that stopped and the requests that failed there;
        then advance the lookahead's sequences, now that their inputs, the tokens just appended, are
        known (prefix-cache hashes need them). Drop the lookahead if all its sequences ended."""
        for seq, status in ended:
            self.scheduler.finish(seq, status)
        self.inputs.forget(seq for seq, _ in ended)
        for rid in failed:
            seqs = self.scheduler.abort(rid, SequenceStatus.FINISHED_ERROR)
            if seqs:
                self.inputs.forget(seqs)
                self.num_failed_requests += 1
        nxt = self._inflight
        if nxt is not None:
            self.scheduler.postprocess(nxt.out)
            if not any(seq.status == SequenceStatus.RUNNING for seq in nxt.lanes):
                self._inflight = None

    def _lanes(self, out: SchedulerOutput) -> tuple[list[Sequence], list[int]]:
        lanes, rows, sample_row = [], [], {}
        for i, s in enumerate(out.scheduled):
            if s.sample:
                sample_row[i] = len(sample_row)
                lanes.append(s.seq)
                rows.append(sample_row[i])
        for parent_idx, child in out.forks:
            lanes.append(child)
            rows.append(sample_row[parent_idx])
        return lanes, rows

    def _launch(self, out: SchedulerOutput) -> _Step | None:
        """Account for a scheduled step and launch its forward and sampling (no sync). A fault traced to
        a sequence before the forward fails its request, and the step is rebuilt without it."""
        had_swap_in = bool(out.swap_in)
        while True:
            lanes, rows = self._lanes(out)
            try:
                handle = self.runner.execute(self.inputs.build(out, lanes, rows))
                break
            except RequestFaults as f:
                self._fail_faults(f.faults, [s.seq for s in out.scheduled] + [c for _, c in out.forks],
                                  "step inputs")
                out = _without_finished(out)
                out.copy_on_write, out.swap_in = [], []  # done (or queued) before the inputs were built
                if not out.scheduled:
                    if had_swap_in:
                        self.runner.flush_swaps()
                    return None
        self._pending.side_outputs.extend(self.runner.take_side_outputs())
        for s in out.scheduled:
            self._pending.scheduled_request_ids.add(s.seq.request_id)
            if s.start < s.seq.num_prompt_tokens:
                self.prompt_tokens_total += min(s.num_tokens, s.seq.num_prompt_tokens - s.start)
        self._pending.forked.extend(c for _, c in out.forks if not c.status.is_finished)
        self.scheduler.postprocess(out)
        if handle is None:  # prefill chunks only: nothing sampled
            return None
        return self._started(out, lanes, handle)

    def _started(self, out: SchedulerOutput, lanes: list[Sequence], handle: StepHandle, lookahead=False) -> _Step:
        complete = not handle.faults
        if not complete:
            self._fail_faults(handle.faults, lanes, "sampling")
            lanes = [s for s in lanes if s.seq_id not in handle.faults]  # the rows the sampler kept
        return _Step(out, lanes, handle, complete=complete, lookahead=lookahead)

    def _launch_lookahead(self, prev: _Step) -> _Step | None:
        """Launch the decode step after ``prev`` with ``prev``'s tokens, still on the device, as its
        inputs; None where that step is not certain to be the next one (see Scheduler.schedule_lookahead)
        or a request needs its tokens on the host first (penalties, logits processors, a grammar) or is
        about to end by length, or ``prev`` verified drafts (how many tokens each sequence keeps is known
        on the host only). With a proposer, a lookahead follows only a step without drafts that was not
        itself a lookahead: the step after a lookahead is scheduled afresh, so the proposer is asked. A request that ends on a stop token or string at ``prev`` wastes one token of
        work, discarded. With a grammar lane only the forward is launched: its sampling waits until
        ``prev``'s tokens are read and accepted (``StepHandle.sample``), since each lane's mask depends on
        its last token."""
        if not prev.complete or prev.handle.deferred or (self.proposer is not None and (
                prev.lookahead or any(e.draft_token_ids for e in prev.out.scheduled))):
            return None
        for seq in prev.lanes:
            p = seq.params
            n_out = seq.num_output_tokens + 1  # with prev's token
            if p.has_penalties or p.logits_processors or p.return_routed_experts \
                    or (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens + 1 >= self.max_model_len:
                return None
        out = self.scheduler.schedule_lookahead(prev.out)
        if out is None:
            return None
        if out.swap_out:  # evictions to the host tier (a lookahead never swaps in)
            self.runner.swap_out(out.swap_out)
        lanes = [s.seq for s in out.scheduled]  # prev's lanes, in prev's order
        defer = any(seq.grammar is not None for seq in lanes)
        try:
            handle = self.runner.execute(self.inputs.build(out, lanes, list(range(len(lanes))), lookahead=True,
                                                           defer_sample=defer))
        except RequestFaults as f:
            # the block copies ran before the inputs were built; the next schedule() takes it from here
            self._fail_faults(f.faults, lanes, "step inputs")
            return None
        self.num_lookahead_steps += 1
        if defer:
            self.num_grammar_lookahead_steps += 1
            return _Step(out, lanes, handle, lookahead=True)
        return self._started(out, lanes, handle, lookahead=True)

    def _read(self, step: _Step) -> list[SampledToken]:
        """Wait for the step's tokens on the host (the one sync) and append them to their sequences."""
        got = step.handle.output()
        at = {rid: i for i, rid in enumerate(got.req_ids)}
        live = [(seq, at[seq.seq_id]) for seq in step.lanes if seq.seq_id in at and not seq.status.is_finished]
        accepted = _accept_grammar_tokens([(seq, got.token_ids[i]) for seq, i in live if seq.grammar is not None])
        sampled = []
        for seq, i in live:
            if seq.status.is_finished:  # failed by the grammar of another sample of its request
                continue
            tokens = got.token_ids[i]
            if seq.grammar is not None:
                ok = accepted[seq.seq_id]
                if ok is not True:  # its grammar is the request's own: it fails alone
                    e = ok if isinstance(ok, BaseException) else ValueError(
                        f"token {tokens[ok]} is not allowed by the grammar")
                    self.fail(seq.request_id, _message("grammar", e))
                    continue
            for tok in tokens:
                seq.append_token(tok)
            st = SampledToken(seq, tokens)
            if got.logprobs is not None and seq.params.logprobs is not None:
                st.logprobs, st.ranks, st.top = got.logprobs[i], got.ranks[i], got.top[i]
            sampled.append(st)
        for entry in step.out.scheduled:  # a multi-token step: the KV of the kept drafts is valid
            if entry.draft_token_ids:
                i = at.get(entry.seq.seq_id)
                kept = 0 if i is None else len(got.token_ids[i]) - 1
                self.draft_counts.add(len(entry.draft_token_ids), kept)
                self.scheduler.accept_drafts(entry, kept)
        return sampled


def _accept_grammar_tokens(lanes: list[tuple[Sequence, list[int]]]) -> dict:
    """seq_id -> True, the index of the first token refused, or the exception, for each (sequence with a grammar,
    its tokens of the step) (turnout/structured/matcher.py accept_step_tokens)."""
    if not lanes:
        return {}
    from turnout.structured.matcher import accept_step_tokens

    return dict(zip((seq.seq_id for seq, _ in lanes), accept_step_tokens([(seq.grammar, t) for seq, t in lanes])))


def _without_finished(out: SchedulerOutput) -> SchedulerOutput:
    """``out`` without the entries and forks of sequences that ended since it was scheduled."""
    keep = [i for i, s in enumerate(out.scheduled) if not s.seq.status.is_finished]
    new_index = {old: new for new, old in enumerate(keep)}
    return SchedulerOutput(scheduled=[out.scheduled[i] for i in keep],
                           forks=[(new_index[p], c) for p, c in out.forks
                                  if p in new_index and not c.status.is_finished],
                           copy_on_write=out.copy_on_write, preempted=out.preempted,
                           num_batched_tokens=sum(out.scheduled[i].num_tokens for i in keep),
                           swap_out=out.swap_out, swap_in=out.swap_in)
