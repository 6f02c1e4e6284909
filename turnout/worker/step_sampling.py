"""The rank's side of drawing tokens: what it keeps per request (``CachedRequest``, from the step contract's
``NewRequest``), the per-row sampling inputs of a step (one row per position drawn: 1 + the drafts of an
entry), and ``StepHandle``, the launched step the engine holds until it reads the draws back.

Acceptance of drafts is on the host, at read-back: the draws of an entry's k + 1 positions come down in
the step's one copy, and the longest prefix of drafts equal to the draws before them is kept, plus the
draw after it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from turnout.layers.sampler import SamplerOutput, SamplingBatch
from turnout.structured.matcher import DraftedGrammarState
from turnout.worker.step import ModelRunnerOutput, NewRequest, SamplingSpec


@dataclass
class CachedRequest:
    """What the rank keeps of a request between steps; the sampling constants made to fit their tensors
    once (top_k above the vocabulary is off, seeds are 63-bit, ids outside the vocabulary are dropped: they
    must never wrap onto real tokens)."""

    req_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    spec: SamplingSpec
    top_k: int
    seed: int
    banned: tuple[int, ...]
    bias: tuple[tuple[int, float], ...]
    prompt_logprobs: int | None
    return_routed_experts: bool

    @classmethod
    def from_new(cls, new: NewRequest, vocab: int) -> CachedRequest:
        s = new.sampling
        return cls(new.req_id, new.request_id, new.index, list(new.prompt_token_ids), s,
                   s.top_k if 0 < s.top_k < vocab else 0, s.seed % 2**63,
                   tuple(sorted(t for t in set(s.min_tokens_banned) if 0 <= t < vocab)),
                   tuple((t, float(v)) for t, v in s.logit_bias if 0 <= t < vocab),
                   new.prompt_logprobs, new.return_routed_experts)


def lane_values(req: CachedRequest, step: int) -> tuple:
    """One drawn row's sampling inputs at output step ``step``."""
    s = req.spec
    banned = req.banned if step < s.min_tokens else ()
    return (float(s.temperature), req.top_k, float(s.top_p), float(s.min_p), req.seed, step, banned, req.bias)


def _pad(rows: list[list[int]]) -> list[list[int]]:
    width = max(1, max(len(r) for r in rows))
    return [r + [-1] * (width - len(r)) for r in rows]


def build_batch(t, lanes: list[tuple[CachedRequest, object, list[int]]], vals: list[tuple], rows: list[int],
                row_lanes: list[tuple[int, int]], want_logprobs: int, pending: int) -> SamplingBatch:
    """``t(list, dtype)``: a tensor on the device. ``lanes``: (request, SampleRequest, drafts) per lane;
    ``vals``, ``rows``, ``row_lanes``: per drawn row, its inputs, its logits row and (lane, j): the row
    draws lane's token after its first j drafts, which count as drawn for its penalties and processors."""
    temperature, top_k, top_p, min_p, seeds, steps, banned, bias = (list(c) for c in zip(*vals))
    b = SamplingBatch(rows=t(rows, torch.long), temperature=t(temperature, torch.float32),
                      top_k=t(top_k, torch.int32), top_p=t(top_p, torch.float32), min_p=t(min_p, torch.float32),
                      seeds=t(seeds, torch.long), steps=t(steps, torch.long),
                      seq_ids=[lanes[lane][0].req_id for lane, _ in row_lanes])

    def history(lane: int, j: int) -> list[int]:
        _, smp, drafts = lanes[lane]
        return list(smp.output_token_ids or ()) + list(drafts[:j])

    for r, (lane, j) in enumerate(row_lanes):  # per-request stages on the logits
        req, smp, _ = lanes[lane]
        if req.spec.logits_processors:
            b.processors.append((r, list(req.spec.logits_processors), history(lane, j)))
        if smp.grammar is not None:  # row j: the state after the lane's first j drafts
            b.grammars.append((r, smp.grammar if j == 0 else DraftedGrammarState(smp.grammar, lanes[lane][2][:j])))
    specs = [lanes[lane][0].spec for lane, _ in row_lanes]
    if any(s.has_penalties for s in specs):
        if pending:
            raise ValueError("penalties need every drawn token on the host: no lookahead step for them")
        b.output_ids = t(_pad([history(lane, j) for lane, j in row_lanes]), torch.long)
        b.prompt_ids = t(_pad([lanes[lane][0].prompt_token_ids for lane, _ in row_lanes]), torch.long)
        b.presence = t([s.presence_penalty for s in specs], torch.float32)
        b.frequency = t([s.frequency_penalty for s in specs], torch.float32)
        b.repetition = t([s.repetition_penalty for s in specs], torch.float32)
    if any(banned):
        b.banned = t(_pad([list(x) for x in banned]), torch.long)
    if any(bias):
        width = max(len(x) for x in bias)
        b.bias_ids = t([[i for i, _ in x] + [-1] * (width - len(x)) for x in bias], torch.long)
        b.bias_values = t([[v for _, v in x] + [0.0] * (width - len(x)) for x in bias], torch.float32)
    b.want_logprobs = want_logprobs >= 0
    b.max_logprobs = max(want_logprobs, 0)
    return b


class StepHandle:
    """A launched step's draws: on the device (``result``), their host copy on the way (``start_readback``).
    ``faults``: requests left out of the draw (known at launch). ``output()`` waits for the copy and
    returns the accepted tokens per request."""

    def __init__(self, req_ids: list[int], drafts: list[list[int]], faults: dict[int, BaseException],
                 draw=None, result: SamplerOutput | None = None, readback=None):
        self.req_ids, self.drafts = req_ids, drafts  # per lane, before the sampler dropped any
        self.faults = dict(faults)
        self._draw, self._readback = draw, readback
        self.result = self.host = self.ready = None
        if result is not None:
            self._set(result)

    @property
    def deferred(self) -> bool:
        return self.result is None

    def sample(self, ended: set[int] = frozenset()) -> StepHandle:
        """Draw a deferred step (grammar lanes): ``ended``, requests that ended since it was launched (their
        grammar rows are dropped: their states may be done)."""
        self._set(self._draw(ended))
        self._draw = None
        return self

    def _set(self, result: SamplerOutput) -> None:
        self.faults.update(result.faults)
        self.result = result
        self.host, self.ready = self._readback(result)

    def output(self) -> ModelRunnerOutput:
        if self.ready is not None:
            self.ready.synchronize()  # this step's copy only, not a step queued behind it
        r = self.host
        tokens = r.tokens.tolist()
        lps = ranks = top_ids = top_lps = None
        if r.logprobs is not None:
            lps, ranks = r.logprobs.tolist(), r.ranks.tolist()
            if r.top_ids is not None:
                top_ids, top_lps = r.top_ids.tolist(), r.top_logprobs.tolist()
        out = ModelRunnerOutput(faults=self.faults)
        if lps is not None:
            out.logprobs, out.ranks, out.top = [], [], []
        at = 0
        for rid, drafts in zip(self.req_ids, self.drafts):
            if rid in self.faults:  # left out by the sampler: it drew no row
                continue
            n = len(drafts) + 1
            draws = tokens[at:at + n]
            keep = 1
            while keep < n and drafts[keep - 1] == draws[keep - 1]:
                keep += 1
            out.req_ids.append(rid)
            out.token_ids.append(draws[:keep])
            if lps is not None:
                out.logprobs.append(lps[at:at + keep])
                out.ranks.append(ranks[at:at + keep])
                out.top.append([list(zip(top_ids[j], top_lps[j])) for j in range(at, at + keep)]
                               if top_ids is not None else [[] for _ in range(keep)])
            at += n
        return out


def start_readback(device, stream, result: SamplerOutput):
    """Queue the copy of a step's sampler output to pinned host memory on a side stream, after the sampler,
    with an event: neither does a step launched after this one delay reading this one's tokens, nor does
    the copy delay that step. Returns (host-side SamplerOutput, event or None where the device is the host)."""
    if device.type != "cuda":
        return result, None
    sampled = torch.cuda.Event()
    sampled.record()
    stream.wait_event(sampled)  # the copy waits for the sampler; the next step does not wait for it
    host = {}
    with torch.cuda.stream(stream):
        for f in dataclasses.fields(result):
            t = getattr(result, f.name)
            if isinstance(t, torch.Tensor):  # not the faults (host-side already)
                t.record_stream(stream)
                host[f.name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host[f.name].copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return dataclasses.replace(result, **host), event
