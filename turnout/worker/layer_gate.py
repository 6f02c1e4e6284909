"""How a step's forward waits for its swap-ins layer by layer: a gate per layer and the cache list that passes it.

Separate from the copies (worker/kv_transfer.py) because the forward's side needs only this: the runner and
the worker wrap the caches in ``LayerGatedCaches`` without touching how the bytes move, and the gate's action
(wait on an event, or run an in-line copy) is whatever the transfer handed it.
"""

from __future__ import annotations

from collections.abc import Sequence


class LayerGate:
    """What must happen before layer i of this step's forward reads its cache: wait for its async copy
    (an event), or run its in-line copy. Each layer's action runs once."""

    def __init__(self, num_layers: int, before):
        self._before = before  # before(i): the layer's wait or copy
        self._done = [False] * num_layers

    def layer(self, i: int) -> None:
        if not self._done[i]:
            self._done[i] = True
            self._before(i)

    def finish(self) -> None:
        """Every layer's wait or copy (before a CUDA-graph replay, which reads every layer)."""
        for i in range(len(self._done)):
            self.layer(i)


class LayerGatedCaches(Sequence):
    """The per-layer caches as the model sees them for one step: fetching layer i (the decoder zips its
    layers with this, so layer i is fetched just before it runs) first passes that layer's gate."""

    def __init__(self, caches, gate: LayerGate):
        self._caches, self._gate = caches, gate

    def __len__(self) -> int:
        return len(self._caches)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        self._gate.layer(i if i >= 0 else len(self) + i)
        return self._caches[i]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]
