"""Per-sequence grammar state: which tokens may come next, and the tokens accepted so far.

One ``GrammarState`` a sequence (a request with n > 1 has n of them: ``fork``). The engine's loop with
async scheduling: after step N's token of a sequence is known on the host, ``accept_token`` it, then
``fill_bitmask`` its row for step N + 1 while the device still runs step N; the mask goes up with the
step's other sampling inputs and ``apply_token_bitmask`` runs just before the sampler.
"""

from __future__ import annotations

from typing import Sequence

import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """[rows, ceil(V/32)] int32 on the host, every token allowed (-1 is all 32 bits set)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


class GrammarState:
    def __init__(self, compiled, vocab_size: int, _matcher=None):
        from turnout.structured.grammar import import_xgrammar

        xgr = import_xgrammar()

        self.compiled = compiled
        self.vocab_size = vocab_size
        self._matcher = _matcher if _matcher is not None else xgr.GrammarMatcher(compiled)
        self.num_accepted = 0  # tokens accepted since the start (what rollback can undo)
        # A dead end: the text so far allows no next token and is not complete either (a rule such as
        # ``b ::= b`` reached after some text). The sequence then ends there, with a stop token, rather
        # than being sampled from a row of -inf: ``_dead`` allows only the stop tokens, ``_ended`` is set
        # once one is accepted (the matcher itself would refuse it).
        self._dead = False
        self._ended = False

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False: the grammar does not allow it here (the state is unchanged);
        with the mask applied that cannot happen, so the engine fails the request."""
        if self._dead:
            if self._ended or int(token_id) not in self._matcher.stop_token_ids:
                return False
            self._ended = True
            self.num_accepted += 1
            return True
        ok = self._matcher.accept_token(int(token_id))
        if ok:
            self.num_accepted += 1
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Accept tokens in order until one is refused; returns how many were accepted."""
        for n, t in enumerate(token_ids):
            if not self.accept_token(t):
                return n
        return len(token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> bool:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, on the host). Returns whether the row
        forbids anything (False: every token is allowed, the row need not be applied). A terminated state
        (its stop token accepted) allows only the stop tokens."""
        if self._dead or self._matcher.is_terminated():
            self._stop_only(bitmask, row)
            return True
        applies = bool(self._matcher.fill_next_token_bitmask(bitmask, row))
        # numpy's any: half the cost of torch's on one row (a few microseconds, next to the fill's 6-8)
        if applies and not bitmask.numpy()[row].any() and not self._matcher.is_completed():
            self._dead = True
            self._stop_only(bitmask, row)
        return applies

    def _stop_only(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        for t in self._matcher.stop_token_ids:
            bitmask[row, t // 32] |= _bit(t % 32)

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the sequence is finished."""
        return self._ended or self._matcher.is_terminated()

    @property
    def at_dead_end(self) -> bool:
        """The last fill found no allowed token in an incomplete text (only the stop tokens are allowed now)."""
        return self._dead

    def is_completed(self) -> bool:
        """The text so far is a complete match (a stop token would be allowed now), or a dead end."""
        return self._dead or self._matcher.is_completed()

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a discarded lookahead token, a rejected draft)."""
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(f"rollback of {num_tokens} tokens, but {self.num_accepted} were accepted")
        if num_tokens and self._ended:  # the stop token accepted at a dead end: not in the matcher
            self._ended = False
            self.num_accepted -= 1
            num_tokens -= 1
        if num_tokens:
            self._dead = False  # the next fill finds out again
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def reset(self) -> None:
        """Back to the start (a preempted sequence recomputed from its prompt keeps its tokens: it does not
        reset; this is for reuse)."""
        self._matcher.reset()
        self.num_accepted = 0
        self._dead = self._ended = False

    def fork(self) -> "GrammarState":
        """An independent copy in the same state (n > 1 samples of one prompt)."""
        twin = GrammarState(self.compiled, self.vocab_size, _matcher=self._matcher.fork())
        twin.num_accepted = self.num_accepted
        twin._dead, twin._ended = self._dead, self._ended
        return twin


class DraftedGrammarState:
    """The state a sequence's grammar would be in after its first drafts: what row j of a lane verified with
    drafts is masked by (the target's draw at that row follows drafts[:j]). The drafts are accepted for the
    fill and rolled back after it, so the sequence's own state never moves until its kept tokens are read."""

    def __init__(self, state: GrammarState, drafts: Sequence[int]):
        self.state, self.drafts = state, list(drafts)

    def _advanced(self, fn):
        before = self.state.num_accepted
        try:
            n = self.state.accept_tokens(self.drafts)
            if n < len(self.drafts):  # checked when proposed (valid_draft_prefix): a bug, not the request's
                raise RuntimeError(f"draft token {self.drafts[n]} at position {n} is not allowed by the grammar")
            return fn()
        finally:
            self.state.rollback(self.state.num_accepted - before)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> bool:
        return self._advanced(lambda: self.state.fill_bitmask(bitmask, row))

    def is_terminated(self) -> bool:
        return self._advanced(self.state.is_terminated)


def accept_until_end(state, token_ids: Sequence[int]) -> int:
    """Accept ``token_ids`` in order until one is refused or one ends the grammar; how many were accepted."""
    n = 0
    for t in token_ids:
        if not state.accept_token(t):
            break
        n += 1
        if state.is_terminated():
            break
    return n


def valid_draft_prefix(state: GrammarState, drafts: Sequence[int]) -> int:
    """How many of ``drafts`` the grammar allows in a row from ``state`` (left unchanged), stopping after a
    token that ends it: drafts past that point could never be kept."""
    before = state.num_accepted
    try:
        return accept_until_end(state, drafts)
    finally:
        state.rollback(state.num_accepted - before)


def accept_step_tokens(pairs: Sequence[tuple[GrammarState, Sequence[int]]]) -> list:
    """Each (state, its tokens of a step) -> True, the index of the first token refused, or the exception its
    state raised. The one-token lanes go through one ``accept_batch`` call; a lane that kept drafts accepts its
    tokens in order, up to a token that ends its grammar (the output processor ends the sequence there)."""
    out: list = [None] * len(pairs)
    single = [i for i, (_, toks) in enumerate(pairs) if len(toks) == 1]
    for i, ok in zip(single, accept_batch([(pairs[i][0], pairs[i][1][0]) for i in single])):
        out[i] = True if ok is True else 0 if ok is False else ok
    for i, (state, toks) in enumerate(pairs):
        if len(toks) > 1:
            try:
                n = accept_until_end(state, toks)
                out[i] = True if n == len(toks) or state.is_terminated() else n
            except Exception as e:  # noqa: BLE001 - the request's grammar: it fails alone
                out[i] = e
    return out


def accept_batch(pairs: Sequence[tuple[GrammarState, int]], *, batch_from: int = 8) -> list:
    """Accept one token per state: for each pair True (accepted), False (refused: the state is unchanged)
    or the exception its state raised. From ``batch_from`` plain states on, one xgrammar call accepts them
    all (one crossing into C++ instead of one a lane: a batch of 256 pays it once a step); a batch call
    that raises is redone state by state, so a fault is traced to its lane."""
    if len(pairs) >= batch_from and all(type(s) is GrammarState and not s._dead for s, _ in pairs):
        from turnout.structured.grammar import import_xgrammar

        try:
            oks = import_xgrammar().BatchGrammarMatcher.batch_accept_token([s._matcher for s, _ in pairs],
                                                                          [int(t) for _, t in pairs])
        except Exception:  # noqa: BLE001 - whose? one by one below
            oks = None
        if oks is not None:
            for (s, _), ok in zip(pairs, oks):
                if ok:
                    s.num_accepted += 1
            return [bool(ok) for ok in oks]
    out = []
    for s, t in pairs:
        try:
            out.append(bool(s.accept_token(t)))
        except Exception as e:  # noqa: BLE001 - the request's grammar: it fails alone
            out.append(e)
    return out


def _bit(k: int) -> int:
    """Bit k of an int32 word as a Python int in int32 range (bit 31 is the sign)."""
    return -(2**31) if k == 31 else 1 << k


def fill_batch_bitmask(states: Sequence[GrammarState | None], bitmask: torch.Tensor, *, threads=None,
                       parallel_from: int = 8) -> list[int]:
    """Fill row i of ``bitmask`` for every constrained sequence i of a batch (None: unconstrained, row left
    as it is) and return the rows to apply: the ``indices`` argument of ``apply_token_bitmask``.

    ``threads``: an xgrammar ``BatchGrammarMatcher`` (``batch_filler()``); with at least ``parallel_from``
    live rows it fills them on its threads (each row costs tens to hundreds of microseconds, which adds up
    at a batch of 256). Rows it fills are all applied (it does not say which allow everything)."""
    live = [(i, s) for i, s in enumerate(states) if s is not None and not s.is_terminated()]
    if threads is None or len(live) < parallel_from:
        return [i for i, s in enumerate(states) if s is not None and s.fill_bitmask(bitmask, i)]
    threads.batch_fill_next_token_bitmask([s._matcher for _, s in live], bitmask, indices=[i for i, _ in live])
    refill_dead_ends(live, bitmask)
    for i, s in enumerate(states):
        if s is not None and s.is_terminated():
            s.fill_bitmask(bitmask, i)
    return [i for i, s in enumerate(states) if s is not None]


def refill_dead_ends(live: Sequence[tuple[int, "GrammarState"]], bitmask: torch.Tensor) -> None:
    """After a batched fill: rows that allow nothing go through ``fill_bitmask``, which ends a dead end."""
    if not live:
        return
    rows = torch.tensor([i for i, _ in live], dtype=torch.int64)
    for k in (~bitmask[rows].any(dim=1)).nonzero().flatten().tolist():
        i, s = live[k]
        s.fill_bitmask(bitmask, i)


def batch_filler(max_threads: int | str = "auto"):
    """The thread pool ``fill_batch_bitmask`` fills large batches with (one per engine)."""
    from turnout.structured.grammar import import_xgrammar

    return import_xgrammar().BatchGrammarMatcher(max_threads)
