"""From logits to tokens: the per-request stages (logits processors, the grammar bitmask through the
runner's BitmaskStage and the ``apply_token_bitmask`` op), penalties and min_tokens in torch, then the
`sample` op, plus logprobs (of the masked logits).

A per-request stage that raises drops its lane from the batch and is reported in
``SamplerOutput.faults`` (seq_id -> exception): the engine core fails that request and the other lanes
are sampled as if it had never been there. Token ids outside [0, vocab) never index a real token: they
go to a pad column that is cut off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Callable, Protocol

import torch

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]  # (output ids, logits [V]) -> logits [V]


class GrammarState(Protocol):
    """What the step needs of a sample's structured-output state (turnout/structured/matcher.py has the
    real one; Sequence.grammar holds it): the sampler has it fill its row of the next token's bitmask,
    the engine core tells it the token drawn. Raising (or refusing the token) fails that request only."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> bool: ...

    def accept_token(self, token_id: int) -> bool: ...

    def fork(self) -> GrammarState: ...


@dataclass
class SamplingBatch:
    """Per-lane sampling inputs, built by the model runner (one lane = one token to draw)."""

    rows: torch.Tensor  # [L] int64: which logits row each lane samples from
    temperature: torch.Tensor  # [L] f32
    top_k: torch.Tensor  # [L] i32
    top_p: torch.Tensor  # [L] f32
    min_p: torch.Tensor  # [L] f32
    seeds: torch.Tensor  # [L] i64
    steps: torch.Tensor  # [L] i64
    # Penalties (None when no lane has any): token histories as padded id matrices (-1 = pad).
    presence: torch.Tensor | None = None  # [L] f32
    frequency: torch.Tensor | None = None  # [L] f32
    repetition: torch.Tensor | None = None  # [L] f32
    output_ids: torch.Tensor | None = None  # [L, maxlen] i64
    prompt_ids: torch.Tensor | None = None  # [L, maxlen] i64
    # Token ids to forbid per lane (min_tokens not reached: EOS and stop ids): [L, m] i64, -1 = pad.
    banned: torch.Tensor | None = None
    # logit_bias (None when no lane has one): [L, m] token ids (-1 = pad) and the values added to them
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None  # [L, m] f32
    max_logprobs: int = 0  # top-N logprobs to return (0: only when a lane asked, the sampled one)
    want_logprobs: bool = False
    seq_ids: list[int] = field(default_factory=list)  # [L]: whose lane it is (faults are reported by seq_id)
    # per-request stages, on the lanes that have them: (lane, its processors, its output token ids)
    processors: list[tuple[int, list[LogitsProcessor], list[int]]] = field(default_factory=list)
    grammars: list[tuple[int, GrammarState]] = field(default_factory=list)  # (lane, its grammar state)

    def select(self, keep: list[int]) -> SamplingBatch:
        """The batch of the lanes ``keep`` (in order): every per-lane tensor and list cut to them."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.rows.device)
        new = {f.name: getattr(self, f.name).index_select(0, idx) for f in fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        where = {old: i for i, old in enumerate(keep)}
        return SamplingBatch(**new, max_logprobs=self.max_logprobs, want_logprobs=self.want_logprobs,
                             seq_ids=[self.seq_ids[i] for i in keep],
                             processors=[(where[i], f, o) for i, f, o in self.processors if i in where],
                             grammars=[(where[i], g) for i, g in self.grammars if i in where])


def _in_vocab(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids with everything outside [0, vocab) (pads, a stray out-of-vocabulary id) sent to column vocab."""
    return torch.where((ids >= 0) & (ids < vocab), ids, torch.full_like(ids, vocab))


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, _in_vocab(ids, vocab), torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]  # the pad (-1) lands in column `vocab`, dropped


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    vocab = logits.shape[-1]
    if b.output_ids is not None:
        out_counts = _counts(b.output_ids, vocab)
        seen = out_counts > 0
        if b.prompt_ids is not None:
            seen = seen | (_counts(b.prompt_ids, vocab) > 0)
        rep = b.repetition[:, None]
        # HF/vLLM repetition penalty: divide positive logits, multiply negative ones, on seen tokens.
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - b.frequency[:, None] * out_counts - b.presence[:, None] * (out_counts > 0).float()
    if b.bias_ids is not None:
        bias = torch.zeros(logits.shape[0], vocab + 1, dtype=logits.dtype, device=logits.device)
        bias.scatter_add_(1, _in_vocab(b.bias_ids, vocab), b.bias_values.to(logits.dtype))
        logits = logits + bias[:, :vocab]
    if b.banned is not None:
        mask = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
        mask.scatter_(1, _in_vocab(b.banned, vocab), True)
        logits = logits.masked_fill(mask[:, :vocab], float("-inf"))
    return logits


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [L] i64
    logprobs: torch.Tensor | None = None  # [L] f32, the sampled token's logprob
    ranks: torch.Tensor | None = None  # [L] i64, its rank (1 = most likely)
    top_ids: torch.Tensor | None = None  # [L, N]
    top_logprobs: torch.Tensor | None = None  # [L, N]
    # lanes left out by a fault in a per-request stage: seq_id -> exception (the rows above are the rest)
    faults: dict[int, BaseException] = field(default_factory=dict)


def _request_stages(ops, logits: torch.Tensor, b: SamplingBatch, grammar_stage
                    ) -> tuple[torch.Tensor, dict[int, BaseException]]:
    """Run each lane's logits processors, then its grammar's bitmask, on its row. Returns the logits and
    the faults by seq_id (a faulty lane's row is left as it was; the caller drops it)."""
    faults: dict[int, BaseException] = {}
    logits = logits.clone()  # the forward's buffer (a CUDA graph's output) stays untouched
    for lane, procs, out_ids in b.processors:
        try:
            row = logits[lane]
            for fn in procs:
                row = fn(out_ids, row)
            if not isinstance(row, torch.Tensor) or row.shape != logits[lane].shape:
                raise ValueError(f"a logits processor must return a tensor of shape {tuple(logits[lane].shape)}")
            logits[lane] = row
        except Exception as e:  # noqa: BLE001 - the request's own code: it fails alone
            faults[b.seq_ids[lane]] = e
    grammars = [(lane, g) for lane, g in b.grammars if b.seq_ids[lane] not in faults]
    if grammars:
        if grammar_stage is None:
            raise ValueError("a batch with grammar lanes needs the runner's grammar stage (BitmaskStage)")
        # turnout/structured/mask.py: the rows filled on the host, one copy up, the apply_token_bitmask op
        for lane, e in grammar_stage.apply(ops, logits, grammars).items():
            faults[b.seq_ids[lane]] = e
    return logits, faults


def _grammar_wins(before: torch.Tensor, after: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Where min_tokens' bans left a grammar lane no token at all (its grammar allows only EOS or a stop
    id: the text is complete), the grammar wins: that row is sampled without the bans. A structured output
    stays valid rather than a row of -inf drawing an arbitrary token. ``before``: penalised, unbanned."""
    cuda = after.device.type == "cuda"
    lanes = torch.zeros(after.shape[0], dtype=torch.bool, pin_memory=cuda)
    lanes[[lane for lane, _ in b.grammars]] = True
    dead = (after == float("-inf")).all(-1) & lanes.to(after.device, non_blocking=cuda)  # [L]; no host sync
    return torch.where(dead[:, None], before, after)


def sample(ops, logits: torch.Tensor, b: SamplingBatch, grammar_stage=None) -> SamplerOutput:
    """logits: [R, V] float32 (one row per sequence that reached its end this step). ``grammar_stage``: the
    runner's BitmaskStage (turnout/structured/mask.py), needed when a lane has a grammar."""
    logits = logits.index_select(0, b.rows) if logits.shape[0] != b.rows.shape[0] else logits
    faults: dict[int, BaseException] = {}
    if b.processors or b.grammars:
        logits, faults = _request_stages(ops, logits, b, grammar_stage)
        if faults:  # sample the others as if the faulty lanes had never been there
            keep = [i for i, sid in enumerate(b.seq_ids) if sid not in faults]
            if not keep:
                return SamplerOutput(torch.empty(0, dtype=torch.long, device=logits.device), faults=faults)
            b = b.select(keep)
            logits = logits.index_select(0, torch.tensor(keep, dtype=torch.long, device=logits.device))
    raw = logits  # after the processors and the grammar mask: logprobs are of what may be drawn, as vLLM's
    if b.output_ids is not None or b.banned is not None or b.bias_ids is not None:
        banned = apply_penalties(logits, b)
        if b.banned is not None and b.grammars:
            banned = _grammar_wins(apply_penalties(logits, dataclasses.replace(b, banned=None)), banned, b)
        logits = banned
    tokens = ops.sample(logits.contiguous(), b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps)
    out = SamplerOutput(tokens, faults=faults)
    if b.want_logprobs:
        # Logprobs of the model's distribution (before penalties and temperature), as vLLM's default.
        lp = torch.log_softmax(raw.float(), dim=-1)
        chosen = lp.gather(1, tokens[:, None])[:, 0]
        out.logprobs = chosen
        out.ranks = (lp > chosen[:, None]).sum(-1) + 1
        if b.max_logprobs > 0:
            out.top_logprobs, out.top_ids = lp.topk(b.max_logprobs, dim=-1)
    return out
