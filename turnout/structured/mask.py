"""The sampler's grammar stage: fill the constrained lanes' bitmask rows on the host, send them up, apply.

One ``BitmaskStage`` per model runner. ``apply(ops, logits, grammars)`` takes the batch's ``(lane, state)``
pairs (lane = the logits row) and fills row ``lane`` of a pinned host buffer; the other rows allow every
token. It copies the rows up without blocking and calls ``ops.apply_token_bitmask(logits, mask)``. The
host buffers alternate, and a buffer is refilled only after the event recorded behind its last copy
completed, so a non-blocking copy never reads a row the next step is already rewriting. A state that
raises (or whose batch fill raised) fails its lane alone: ``apply`` returns those faults by lane, and
their rows are left unmasked (the caller drops the lanes)."""

from __future__ import annotations

from typing import Sequence

import torch

from turnout.structured.matcher import GrammarState, bitmask_words, refill_dead_ends


class BitmaskStage:
    def __init__(self, vocab_size: int, max_rows: int, device: torch.device | str = "cpu", *,
                 threads: int | str | None = "auto", parallel_from: int = 8, buffers: int = 2):
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._host = [torch.full((max_rows, self.words), -1, dtype=torch.int32, pin_memory=self._pin)
                      for _ in range(buffers)]
        self._done = [None] * buffers  # the event behind each buffer's last copy
        self._turn = 0
        self._threads = None
        if threads is not None:
            from turnout.structured.matcher import batch_filler

            self._threads = batch_filler(threads)
        self._parallel_from = parallel_from

    def _buffer(self, rows: int) -> tuple[torch.Tensor, int]:
        if rows > self._host[0].shape[0]:  # a larger batch than planned: grow once
            self._host = [torch.full((rows, self.words), -1, dtype=torch.int32, pin_memory=self._pin)
                          for _ in self._host]
            self._done = [None] * len(self._host)
        k = self._turn
        self._turn = (k + 1) % len(self._host)
        if self._done[k] is not None:
            self._done[k].synchronize()  # its previous copy must have read it
            self._done[k] = None
        return self._host[k], k

    def fill(self, grammars: Sequence[tuple[int, object]], host: torch.Tensor) -> tuple[list[int], dict]:
        """Fill row ``lane`` of ``host`` for each (lane, state); (lanes to apply, faults by lane)."""
        faults: dict[int, BaseException] = {}
        live = [(lane, s) for lane, s in grammars if not _terminated(s)]
        if (self._threads is not None and len(live) >= self._parallel_from
                and all(isinstance(s, GrammarState) for _, s in live)):
            try:
                self._threads.batch_fill_next_token_bitmask([s._matcher for _, s in live], host,
                                                            indices=[lane for lane, _ in live])
                refill_dead_ends(live, host)
                rest = [(lane, s) for lane, s in grammars if _terminated(s)]
                lanes = [lane for lane, _ in live]
            except Exception:  # noqa: BLE001 - whose? fill row by row to find out
                rest, lanes = list(grammars), []
        else:
            rest, lanes = list(grammars), []
        for lane, state in rest:
            try:
                if state.fill_bitmask(host, lane):
                    lanes.append(lane)
            except Exception as e:  # noqa: BLE001 - the request's grammar: it fails alone
                faults[lane] = e
        return sorted(lanes), faults

    def apply(self, ops, logits: torch.Tensor, grammars: Sequence[tuple[int, object]]) -> dict[int, BaseException]:
        """Mask ``logits`` [L, V] in place for the constrained lanes; returns the faults by lane."""
        if not grammars:
            return {}
        rows, v = logits.shape
        if v > self.words * 32:
            raise ValueError(f"logits have {v} columns, the stage was built for a vocabulary of {self.vocab_size}")
        host, k = self._buffer(rows)
        lanes, faults = self.fill(grammars, host)
        if not lanes:
            return faults
        if self.device.type == "cpu":
            # No copy to save on the host, and the op's cost there is per row masked: only the constrained rows.
            ops.apply_token_bitmask(logits, host[:rows], torch.tensor(lanes, dtype=torch.int64))
            return faults
        # Every other row allows everything: the kernel then moves none of its logits, and one copy of
        # [L, W] words replaces a mask copy plus an index copy.
        keep = torch.zeros(rows, dtype=torch.bool)
        keep[lanes] = True
        host[:rows][~keep] = -1
        mask = host[:rows].to(self.device, non_blocking=self._pin)  # [L, ceil(V/32)] int32
        if self._pin:
            event = torch.cuda.Event()
            event.record()
            self._done[k] = event
        ops.apply_token_bitmask(logits, mask, None)
        return faults

def _terminated(state) -> bool:
    fn = getattr(state, "is_terminated", None)
    return bool(fn()) if fn is not None else False
