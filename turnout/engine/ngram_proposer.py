"""Prompt lookup (the "ngram" method): the draft is what followed the last earlier occurrence of the
sequence's final n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs before.
Copy-heavy output (code edits, quoting, extraction, summaries that reuse the prompt's phrases) repeats spans
of its context, and those spans come out k + 1 tokens a step.

Cost: each sequence keeps, per n, a dict from an n-gram to the position after its latest occurrence,
extended by the tokens appended since the last step (max - min + 1 dict updates per token), so a step costs
one lookup per n, whatever the context's length; a scan of the whole context per step would make a long
generation quadratic. The dicts go with the sequence once it is no longer running.
"""

from __future__ import annotations

from turnout.engine.sequence import Sequence


class _Index:
    """seq's n-grams for n in [lo, hi], each mapped to the position just after its latest occurrence that
    has a token after it (so the final n tokens, whose next token is not known, are never their own match)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self.indexed = 0  # positions e < indexed have had the n-grams ending at e indexed

    def extend(self, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (it has a next token now)."""
        last = len(tokens) - 1
        for e in range(max(self.indexed, self.lo), last + 1):  # n-gram tokens[e - n:e], followed by tokens[e]
            for n, table in self.after.items():
                if e >= n:
                    table[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, last + 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self.extend(tokens)
        L = len(tokens)
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            at = self.after[n].get(tuple(tokens[L - n:]))
            if at is not None:
                return tokens[at:at + k]
        return []


class NgramProposer:
    """A DraftProposer (engine/drafts.py): up to ``k`` tokens per sequence from its own context."""

    def __init__(self, k: int, prompt_lookup_min: int, prompt_lookup_max: int, max_batch: int | None = None):
        self.k, self.lo, self.hi, self.max_batch = k, prompt_lookup_min, prompt_lookup_max, max_batch
        self._index: dict[int, tuple[Sequence, _Index]] = {}

    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        out = {}
        for seq in seqs:
            held = self._index.get(seq.seq_id)
            if held is None or held[0] is not seq:
                held = self._index[seq.seq_id] = (seq, _Index(self.lo, self.hi))
            draft = held[1].propose(seq.token_ids, self.k)
            if draft:
                out[seq.seq_id] = draft
        if len(self._index) > 2 * len(seqs) + 64:  # forget the sequences that ended or left the running set
            for seq_id in [i for i, (s, _) in self._index.items() if s.status.is_finished]:
                del self._index[seq_id]
        return out
