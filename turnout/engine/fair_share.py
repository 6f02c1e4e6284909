"""Fair share between requests in one scheduler step: how many of its sequences each request may run,
and which of a capped request's sequences take their turn. No torch.

While more than one request has work, one request runs at most ``cap`` of its sequences in a step, where
``cap = max(fair_share_seqs, the most sequences any other request has)``: a request with n = 128 samples
cannot make every step 128 rows long (on a CPU, 1.5 s) while a one-sample request waits behind it, and
two large requests still run at full width. The sequences of a capped request take turns: those with the
fewest output tokens go first. The scheduler takes its preemption victim from a request over its cap
(counting its waiting ones) first.

Separate from the scheduler because it is a pure function of the queues: it can be read, and changed,
without the step's block accounting.
"""

from __future__ import annotations

from collections.abc import Iterable

from turnout.engine.sequence import Sequence


def fair_caps(fair_share_seqs: int | None, running: Iterable[Sequence], waiting: Iterable[Sequence],
              swapped: Iterable[Sequence]) -> tuple[dict[str, int] | None, dict[str, int]]:
    """(request_id -> the most sequences it may run this step, or None when nothing is capped: no
    fair share set, or fewer than two requests with work; request_id -> its sequences with work)."""
    if fair_share_seqs is None:
        return None, {}
    demand: dict[str, int] = {}
    for seq in running:
        demand[seq.request_id] = demand.get(seq.request_id, 0) + 1
    for seq in waiting:
        # a waiting request has not forked yet: it stands for all n of its samples
        demand[seq.request_id] = demand.get(seq.request_id, 0) + seq.n
    for seq in swapped:
        demand[seq.request_id] = demand.get(seq.request_id, 0) + 1
    if len(demand) < 2:
        return None, demand
    first_id, first = max(demand.items(), key=lambda kv: kv[1])
    second = max(d for r, d in demand.items() if r != first_id)
    # the largest request is capped by the second largest; every other one by the largest
    return {r: max(fair_share_seqs, second if r == first_id else first) for r in demand}, demand


def take_turns(decodes: list[Sequence], prefills: list[Sequence], caps: dict[str, int]
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
