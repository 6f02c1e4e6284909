"""The seam for speculative decoding: a ``DraftProposer`` guesses the tokens that follow a decoding
sequence; the engine core asks it before each scheduled step (``EngineCore.proposer``, none by default)
and the step verifies the guesses (worker/step.py: the rank keeps the drafts its own draws confirm, plus
its next draw). A wrong guess costs compute, never output: the tokens are the ones the model draws.

A step with drafts runs without the async lookahead (how many tokens each sequence keeps is known on the
host only once the step is read back), so an engine with a proposer runs every step synchronously.
Sequences with a grammar are not offered (their state follows one token at a time).
"""

from __future__ import annotations

from typing import Protocol

from turnout.engine.sequence import Sequence


class DraftProposer(Protocol):
    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """seq_id -> the tokens guessed to follow each of ``seqs`` (decoding, every token on the host);
        a sequence left out, or given [], is decoded one token as usual."""
        ...


def draftable(seq: Sequence) -> bool:
    """A running sequence decoding one token, with no grammar and no samples still to fork."""
    return seq.num_tokens - seq.num_computed_tokens == 1 and seq.grammar is None and seq.n == 1


def propose(proposer: DraftProposer, running: list[Sequence], vocab_size: int) -> dict[int, list[int]] | None:
    """The proposer's drafts for the draftable ``running`` sequences; a draft outside the vocabulary ends the
    guess there (it would index nothing)."""
    seqs = [s for s in running if draftable(s)]
    if not seqs:
        return None
    drafts = {}
    for seq_id, d in proposer.propose(seqs).items():
        ok = next((i for i, t in enumerate(d) if not (isinstance(t, int) and 0 <= t < vocab_size)), len(d))
        drafts[seq_id] = list(d[:ok])
    return drafts
