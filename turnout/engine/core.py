"""The engine core: schedule -> execute -> update, one step at a time, with the lookahead protocol of
async scheduling (docs/architecture.md). It owns the scheduler and drives the model runner through a
narrow interface (``ModelExecutor``), never touching a tensor's values: a multi-process executor can
take the runner's place.

Fault isolation: a step stage that can trace an exception to a sequence (building its inputs, its
sampling inputs, its logits processors, its grammar mask) reports it (``SequenceFaults`` before the
forward, ``SamplerOutput.faults`` after it). The core fails that sequence's request only
(``SequenceStatus.FINISHED_ERROR``; the output processor reports ``finish_reason == "error"``), rebuilds
the step without it and goes on. Anything else raised by the runner (the forward, the sampler over the
whole batch, a device error) cannot be attributed and propagates: the engine is dead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from turnout.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from turnout.engine.sequence import Sequence, SequenceFaults, SequenceStatus

if TYPE_CHECKING:
    import torch

    from turnout.layers.sampler import SamplerOutput

logger = logging.getLogger(__name__)


class ModelExecutor(Protocol):
    """What the core needs of whatever runs the model (today the in-process ModelRunner)."""

    vocab_size: int
    num_blocks: int

    def execute(self, scheduled: list[ScheduledSeq], lanes: list[Sequence], lane_rows: list[int],
                eos_ids: set[int], want_logprobs: int = -1, copy_on_write=(),
                input_tokens: torch.Tensor | None = None, defer_sample: bool = False
                ) -> SamplerOutput | Callable[[], SamplerOutput] | None: ...

    def start_readback(self, result: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]: ...


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    lookahead_steps_total: int = 0  # decode steps launched before the last one's tokens were read back
    num_failed_requests_total: int = 0  # requests failed by a fault traced to them (the engine went on)
    # KV tiers (worker/kv_transfer.py, kv/tiers.py)
    num_swapped: int = 0  # sequences waiting in host memory to be swapped back in
    swap_preemptions_total: int = 0
    recompute_preemptions_total: int = 0
    swap_pool_full_total: int = 0  # swap chosen, the host pool full: recomputed instead
    swapped_out_blocks_total: int = 0
    swapped_in_blocks_total: int = 0
    host_tier_hit_tokens_total: int = 0  # prefix hits loaded back from host memory (in prefix_cache_hit_tokens_total)
    host_tier_offloaded_blocks_total: int = 0
    host_tier_used_blocks: int = 0


@dataclass
class SampledToken:
    """One sequence's new token, appended to it already, with its logprobs where asked."""

    seq: Sequence
    token: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] = field(default_factory=list)  # the top-N (token, logprob), best first


@dataclass
class CoreOutput:
    sampled: list[SampledToken] = field(default_factory=list)
    forked: list[Sequence] = field(default_factory=list)  # new samples of n > 1 requests, before their tokens
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request_id, message) failed by a fault
    scheduled_request_ids: set[str] = field(default_factory=set)  # requests that computed in a launched step
    # per-request results besides tokens (prompt logprob chunks, routed experts), each with ``request_id``
    side_outputs: list = field(default_factory=list)


@dataclass
class _Step:
    """A launched step: what was scheduled, the sequences that draw a token (in row order), the
    sampler's output on the device, and its copy on the host with the event that says it landed."""

    out: SchedulerOutput
    lanes: list[Sequence]
    result: SamplerOutput | None
    host: SamplerOutput | None
    ready: torch.cuda.Event | None = None
    complete: bool = True  # every sampling entry of ``out`` has its row (no lane was dropped by a fault)
    sample_later: Callable[[], SamplerOutput] | None = None  # a forward whose sampling waits (grammar lanes)


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
        self.scheduler.abort(request_id)

    def fail(self, request_id: str, message: str) -> None:
        """End every sequence of a request with an error; the output processor is told by step()."""
        if self.scheduler.abort(request_id, SequenceStatus.FINISHED_ERROR):
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
            out = self.scheduler.schedule()
            if out.swap_out:  # device -> host first: they read the blocks before this step can write them
                self.runner.swap_out(out.swap_out)
            step = self._launch(out) if out.scheduled else None
        sampled: list[SampledToken] = []
        if step is not None:
            if self.async_scheduling:
                self._inflight = self._launch_lookahead(step)
            sampled = self._read(step)
            nxt = self._inflight
            if nxt is not None and nxt.sample_later is not None:
                # the grammars have accepted this step's tokens: fill the masks and sample the lookahead,
                # whose forward the device has been running meanwhile
                self._inflight = self._started(nxt.out, nxt.lanes, nxt.sample_later())
        result, self._pending = self._pending, CoreOutput()
        result.sampled = sampled
        return result

    def update(self, ended: list[tuple[Sequence, SequenceStatus]], failed: list[str]) -> None:
        """After output processing: end the sequences that stopped and the requests that failed there;
        then advance the lookahead's sequences, now that their inputs, the tokens just appended, are
        known (prefix-cache hashes need them). Drop the lookahead if all its sequences ended."""
        for seq, status in ended:
            self.scheduler.finish(seq, status)
        for rid in failed:
            if self.scheduler.abort(rid, SequenceStatus.FINISHED_ERROR):
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
        cow, swap_in = out.copy_on_write, out.swap_in
        while True:
            lanes, rows = self._lanes(out)
            want = max((s.params.logprobs for s in lanes if s.params.logprobs is not None), default=-1)
            try:
                result = self.runner.execute(out.scheduled, lanes, rows, self.eos_ids, want, cow,
                                             **({"swap_in": swap_in} if swap_in else {}))
                break
            except SequenceFaults as f:
                self._fail_faults(f.faults, [s.seq for s in out.scheduled] + [c for _, c in out.forks],
                                  "step inputs")
                out = _without_finished(out)
                cow = swap_in = ()  # done (or queued) before the inputs were built
                if not out.scheduled:
                    if out.swap_in:
                        self.runner.flush_swaps()
                    return None
        self._pending.side_outputs.extend(self.runner.take_side_outputs())
        for s in out.scheduled:
            self._pending.scheduled_request_ids.add(s.seq.request_id)
            if s.start < s.seq.num_prompt_tokens:
                self.prompt_tokens_total += min(s.num_tokens, s.seq.num_prompt_tokens - s.start)
        self._pending.forked.extend(c for _, c in out.forks if not c.status.is_finished)
        self.scheduler.postprocess(out)
        if result is None:  # prefill chunks only: nothing sampled
            return None
        return self._started(out, lanes, result)

    def _started(self, out: SchedulerOutput, lanes: list[Sequence], result: SamplerOutput) -> _Step:
        complete = not result.faults
        if not complete:
            self._fail_faults(result.faults, lanes, "sampling")
            lanes = [s for s in lanes if s.seq_id not in result.faults]  # the rows the sampler kept
        return _Step(out, lanes, result, *self.runner.start_readback(result), complete=complete)

    def _launch_lookahead(self, prev: _Step) -> _Step | None:
        """Launch the decode step after ``prev`` with ``prev``'s tokens, still on the device, as its
        inputs; None where that step is not certain to be the next one (see Scheduler.schedule_lookahead)
        or a request needs its tokens on the host first (penalties, logits processors, a grammar) or is
        about to end by length. A request that ends on a stop token or string at ``prev`` wastes one
        token of work, discarded. With a grammar lane only the forward is launched: its sampling waits
        until ``prev``'s tokens are read and accepted (``_Step.sample_later``), since each lane's mask
        depends on its last token."""
        if not prev.complete:
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
        lanes = [s.seq for s in out.scheduled]  # prev's lanes, in prev's order: row i = prev's token i
        want = max((s.params.logprobs for s in lanes if s.params.logprobs is not None), default=-1)
        defer = any(seq.grammar is not None for seq in lanes)
        try:
            result = self.runner.execute(out.scheduled, lanes, list(range(len(lanes))), self.eos_ids, want,
                                         out.copy_on_write, input_tokens=prev.result.tokens,
                                         **({"defer_sample": True} if defer else {}))
        except SequenceFaults as f:
            # the block copies ran before the inputs were built; the next schedule() takes it from here
            self._fail_faults(f.faults, lanes, "step inputs")
            return None
        self.num_lookahead_steps += 1
        if defer:
            self.num_grammar_lookahead_steps += 1
            return _Step(out, lanes, None, None, sample_later=result)
        return self._started(out, lanes, result)

    def _read(self, step: _Step) -> list[SampledToken]:
        """Wait for the step's tokens on the host (the one sync) and append them to their sequences."""
        if step.ready is not None:
            step.ready.synchronize()  # this step's copy only, not the lookahead queued behind it
        result = step.host
        tokens = result.tokens.tolist()
        lps = ranks = top_ids = top_lps = None
        if result.logprobs is not None:
            lps, ranks = result.logprobs.tolist(), result.ranks.tolist()
            if result.top_ids is not None:
                top_ids, top_lps = result.top_ids.tolist(), result.top_logprobs.tolist()
        sampled = []
        accepted = _accept_grammar_tokens(step.lanes, tokens)
        for lane, (seq, tok) in enumerate(zip(step.lanes, tokens)):
            if seq.status.is_finished:  # aborted or failed, or ended while a lookahead ran
                continue
            if seq.grammar is not None:
                ok = accepted[lane]
                if ok is not True:  # its grammar is the request's own: it fails alone
                    e = ok if isinstance(ok, BaseException) else ValueError(f"token {tok} is not allowed by the grammar")
                    self.fail(seq.request_id, _message("grammar", e))
                    continue
            seq.append_token(tok)
            st = SampledToken(seq, tok)
            if lps is not None and seq.params.logprobs is not None:
                st.logprob, st.rank = lps[lane], ranks[lane]
                if top_ids is not None:
                    st.top = list(zip(top_ids[lane], top_lps[lane]))
            sampled.append(st)
        return sampled


def _accept_grammar_tokens(lanes: list[Sequence], tokens: list[int]) -> dict:
    """lane -> True, False (refused) or the exception, for the live lanes with a grammar: one batch call
    (turnout/structured/matcher.py accept_batch)."""
    idx = [i for i, seq in enumerate(lanes) if seq.grammar is not None and not seq.status.is_finished]
    if not idx:
        return {}
    from turnout.structured.matcher import accept_batch

    return dict(zip(idx, accept_batch([(lanes[i].grammar, tokens[i]) for i in idx])))


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
