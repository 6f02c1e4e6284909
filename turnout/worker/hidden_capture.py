"""The target's hidden states for the drafters that read them (speculative methods "mtp" and "eagle3",
turnout/engine/hidden_drafts.py): the residual stream at chosen points of each eager forward, kept per request
and position until the drafter has read them.

A point is a decoder layer index i: the stream entering layer i (the output of layer i - 1, ``hidden +
residual``: vLLM's convention for EAGLE-3's auxiliary layers); i == num_hidden_layers is the stream after the
last layer, before the final norm (what DeepSeek's multi-token-prediction layer reads). Several points are
concatenated in their order ([T, len(points) * H]). Forward pre-hooks take them, so the model's code is
unchanged; hooks do not run in a CUDA graph replay, so a runner with a capture runs every step eagerly.

Per request the rows of consecutive positions [base, base + n) are kept. A forward that computes position p
again (drafts rejected, then their positions recomputed) replaces the rows from p on; a gap (positions the
prefix cache supplied, or a preemption's recompute from an earlier position) starts the rows afresh. The
drafter drops what it has read (``release``); a finished request's rows go with ``forget``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CapturedRows:
    base: int  # the position of rows[0]
    rows: torch.Tensor  # [n, W]

    @property
    def end(self) -> int:
        return self.base + self.rows.shape[0]


class HiddenCapture:
    """Hooks on ``model`` (a DecoderForCausalLM: ``model.model.layers``, ``model.model.norm``); ``install`` says
    which points, once the drafter that reads them is built."""

    def __init__(self, model):
        self.model = model
        self.points: tuple[int, ...] = ()
        self._handles: list = []
        self._taken: dict[int, torch.Tensor] = {}  # point -> this forward's [T, H]
        self.store: dict[int, CapturedRows] = {}  # req_id -> its rows not yet read

    def install(self, points: tuple[int, ...]) -> None:
        layers, n = self.model.model.layers, len(self.model.model.layers)
        bad = [p for p in points if not 0 <= p <= n]
        if bad:
            raise ValueError(f"hidden-state point {bad[0]}: the model has layers 0..{n - 1} (and {n}: the final "
                             "stream)")
        for h in self._handles:
            h.remove()
        self.points, self._handles = tuple(points), []
        for p in dict.fromkeys(points):
            if p == n:  # the final norm's input: norm(hidden, residual)
                hook = self._hook(p, 0)
                self._handles.append(self.model.model.norm.register_forward_pre_hook(hook))
            else:  # layer(positions, hidden, residual, kv_cache, meta)
                self._handles.append(layers[p].register_forward_pre_hook(self._hook(p, 1)))

    def _hook(self, point: int, at: int):
        def take(module, args):
            hidden, residual = args[at], args[at + 1] if len(args) > at + 1 else None
            # a new tensor either way: the layers' norms update the stream's tensors in place
            self._taken[point] = hidden.clone() if residual is None else hidden + residual
        return take

    def record(self, scheduled) -> None:
        """After a forward of the ``scheduled`` entries (worker/step.py ScheduledRequest, packed in order)."""
        if not self.points or not self._taken:
            return
        flat = torch.cat([self._taken[p] for p in self.points], dim=-1) if len(self.points) > 1 \
            else self._taken[self.points[0]]
        self._taken = {}
        at = 0
        for s in scheduled:
            n = s.num_query_tokens
            self._put(s.req_id, s.start, flat[at:at + n])
            at += n

    def _put(self, req_id: int, start: int, rows: torch.Tensor) -> None:
        held = self.store.get(req_id)
        if held is None or not held.base <= start <= held.end:
            self.store[req_id] = CapturedRows(start, rows.clone())
        else:
            self.store[req_id] = CapturedRows(held.base, torch.cat([held.rows[:start - held.base], rows]))

    def release(self, req_id: int, before: int) -> None:
        """The drafter has read the rows of positions < ``before``."""
        held = self.store.get(req_id)
        if held is not None and before > held.base:
            keep = held.rows[min(before, held.end) - held.base:]
            self.store[req_id] = CapturedRows(min(before, held.end), keep)

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self.store.pop(r, None)
