"""The engine's half of the step contract (worker/step.py): a scheduled step of ``Sequence`` objects becomes
plain data per request id, and the rank is told once of each request (``NewRequest``) and once of its end.

The rank keeps a request from its first step until its id is listed in ``finished_req_ids``; ids are never
reused (Scheduler.new_seq_id), so a request that failed before the rank kept it is simply sent again as new.
"""

from __future__ import annotations

from turnout.engine.scheduler_output import SchedulerOutput as Schedule
from turnout.engine.sequence import Sequence
from turnout.worker.step import (
    NewRequest,
    RequestFaults,
    SampleRequest,
    SamplingSpec,
    ScheduledRequest,
    SchedulerOutput,
)


def sampling_spec(seq: Sequence, eos_ids: set[int]) -> SamplingSpec:
    p = seq.params
    banned = ()
    if p.min_tokens > 0:
        banned = tuple(sorted((set() if p.ignore_eos else set(eos_ids)) | set(p.stop_token_ids)))
    return SamplingSpec(temperature=float(p.temperature), top_k=int(p.top_k), top_p=float(p.top_p),
                        min_p=float(p.min_p), seed=int(seq.seed), min_tokens=int(p.min_tokens),
                        min_tokens_banned=banned,
                        logit_bias=tuple((int(t), float(v)) for t, v in (p.logit_bias or {}).items()),
                        presence_penalty=float(p.presence_penalty), frequency_penalty=float(p.frequency_penalty),
                        repetition_penalty=float(p.repetition_penalty), has_penalties=bool(p.has_penalties),
                        logprobs=p.logprobs, logits_processors=tuple(p.logits_processors or ()))


def _new_request(seq: Sequence, eos_ids: set[int]) -> NewRequest:
    p = seq.params
    return NewRequest(seq.seq_id, seq.request_id, seq.index, seq.prompt_token_ids, sampling_spec(seq, eos_ids),
                      prompt_logprobs=getattr(p, "prompt_logprobs", None),
                      return_routed_experts=bool(getattr(p, "return_routed_experts", False)))


class StepInputs:
    """Which requests the rank keeps, and the contract of each step."""

    def __init__(self, eos_ids: set[int]):
        self.eos_ids = eos_ids
        self._kept: set[int] = set()  # req ids sent to the rank and not yet finished there
        self._ended: list[int] = []  # to list in the next step's finished_req_ids

    def forget(self, seqs) -> None:
        """Sequences that ended: the rank drops them with the next step."""
        for seq in seqs:
            if seq.seq_id in self._kept:
                self._kept.discard(seq.seq_id)
                self._ended.append(seq.seq_id)

    def build(self, out: Schedule, lanes: list[Sequence], rows: list[int], *, lookahead: bool = False,
              defer_sample: bool = False) -> SchedulerOutput:
        """``lanes``: the sequences that draw, ``rows[i]`` the sampling entry whose logits lane i draws from.
        Raises RequestFaults for the sequences whose request cannot be described (the core fails them)."""
        step = SchedulerOutput(copy_on_write=list(out.copy_on_write), swap_in=list(out.swap_in), lookahead=lookahead,
                               defer_sample=defer_sample)
        faults, news = {}, {}
        for seq in [s.seq for s in out.scheduled] + lanes:
            if seq.seq_id not in self._kept and seq.seq_id not in news:
                try:
                    news[seq.seq_id] = _new_request(seq, self.eos_ids)
                except Exception as e:  # noqa: BLE001 - this request's parameters: it fails alone
                    faults[seq.seq_id] = e
        if faults:
            raise RequestFaults(faults)
        step.new_requests = list(news.values())
        self._kept.update(news)
        step.finished_req_ids, self._ended = self._ended, []
        for s in out.scheduled:
            seq = s.seq
            step.scheduled.append(ScheduledRequest(
                seq.seq_id, s.start, s.num_tokens, None if lookahead else seq.token_ids[s.start:s.start + s.num_tokens],
                (list(seq.block_table),) if not seq.group_tables else tuple(list(t) for t in seq.block_tables),
                s.sample, list(s.draft_token_ids)))
        pending = int(lookahead)
        for seq, row in zip(lanes, rows):
            p = seq.params
            history = seq.output_token_ids if (p.has_penalties or p.logits_processors) else None
            step.samples.append(SampleRequest(seq.seq_id, row, seq.num_output_tokens + pending, history, seq.grammar))
        step.want_logprobs = max((s.params.logprobs for s in lanes if s.params.logprobs is not None), default=-1)
        return step
