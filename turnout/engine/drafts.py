"""The seam for speculative decoding: a ``DraftProposer`` guesses the tokens that follow a decoding
sequence; the engine core asks it before each scheduled step (``EngineCore.proposer``, none by default)
and the step verifies the guesses (worker/step.py: the rank keeps the drafts its own draws confirm, plus
its next draw). A wrong guess costs compute, never output: the tokens are the ones the model draws.

A step with drafts runs without the async lookahead (how many tokens each sequence keeps is known on the
host only once the step is read back); with async scheduling, a step without drafts may be followed by a
lookahead, and the step after that is scheduled afresh, with the proposer asked (engine/core.py).
A sequence with a grammar keeps only the drafts its grammar allows in a row (checked here, its state left
as it was); the rank masks each verified position by the state after the drafts before it
(structured/matcher.py ``DraftedGrammarState``), and the kept tokens are accepted when read. Sequences of a
request that turned speculation off (``SamplingParams.speculative_decoding``); a proposer with ``max_batch`` set is
not asked at all while that many sequences or more run (the batch fills the device: verifying drafts would
cost more than it saves).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from turnout.engine.sequence import Sequence


class DraftProposer(Protocol):
    max_batch: int | None  # no drafts while this many sequences or more run (None: no such limit)

    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """seq_id -> the tokens guessed to follow each of ``seqs`` (decoding, every token on the host);
        a sequence left out, or given [], is decoded one token as usual."""
        ...


def draftable(seq: Sequence) -> bool:
    """A running sequence decoding one token, with no samples still to fork."""
    return (seq.num_tokens - seq.num_computed_tokens == 1 and seq.n == 1
            and getattr(seq.params, "speculative_decoding", True))


def propose(proposer: DraftProposer, running: list[Sequence], vocab_size: int) -> dict[int, list[int]] | None:
    """The proposer's drafts for the draftable ``running`` sequences; a draft outside the vocabulary ends the
    guess there (it would index nothing)."""
    cap = getattr(proposer, "max_batch", None)
    if cap is not None and len(running) >= cap:
        return None
    seqs = [s for s in running if draftable(s)]
    if not seqs:
        return None
    grammars = {s.seq_id: s.grammar for s in seqs if s.grammar is not None}
    drafts = {}
    for seq_id, d in proposer.propose(seqs).items():
        ok = next((i for i, t in enumerate(d) if not (isinstance(t, int) and 0 <= t < vocab_size)), len(d))
        d = list(d[:ok])
        if d and seq_id in grammars:
            d = d[:_grammar_prefix(grammars[seq_id], d)]
        drafts[seq_id] = d
    return drafts


def _grammar_prefix(state, drafts: list[int]) -> int:
    """How many drafts the sequence's grammar allows in a row; 0 where the state cannot say (it fails the request
    at its own next token, not here)."""
    from turnout.structured.matcher import valid_draft_prefix

    try:
        return valid_draft_prefix(state, drafts)
    except Exception:  # noqa: BLE001 - the request's grammar: no drafts, its one-token path reports the fault
        return 0


@dataclass
class DraftCounts:
    """The engine's speculation counters (EngineStats reports them)."""

    num_drafts: int = 0  # (sequence, step) pairs verified with drafts
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [j]: drafts verified at position j
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: of those, kept

    def add(self, drafted: int, kept: int) -> None:
        """One sequence's step verified ``drafted`` drafts and kept the first ``kept``."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_draft_tokens += kept
        for counts, n in ((self.drafted_per_position, drafted), (self.accepted_per_position, kept)):
            counts.extend([0] * (n - len(counts)))
            for j in range(n):
                counts[j] += 1

    def stats(self) -> dict:
        """EngineStats' fields of these counters."""
        return {"draft_tokens_total": self.num_draft_tokens,
                "accepted_draft_tokens_total": self.num_accepted_draft_tokens, "num_drafts_total": self.num_drafts,
                "draft_tokens_per_position": list(self.drafted_per_position),
                "accepted_draft_tokens_per_position": list(self.accepted_per_position)}
