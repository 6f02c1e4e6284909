"""``SamplingParams(return_routed_experts=True)``: the expert ids ``select_experts`` chose in every MoE layer
for every token a request's sequence read, for routing replay in an RL trainer.

``CompletionOutput.routed_experts`` is an int32 numpy array ``[num_prompt_tokens + num_generated_tokens - 1,
num_moe_layers, top_k]``: row p is the routing of the token at position p, and the last generated token is
never read by the model, so it has none (verl's routing replay uses the same length). Layers are the MoE
layers in model order (dense layers skipped); ids in each row are in ``select_experts``' order (best
first). It is set on a finished completion (and an aborted one: the positions computed so far).

Recording: only a step that computes a position of a request asking for it records. The runner hands
every ``SparseMoeBlock`` the same list (its ``record_routing``) for the forward; each block appends the
``topk_ids`` it routed with, so nothing is copied or kept in the other steps. Such a step runs eagerly
(a CUDA graph replay runs no Python), and tells the other tensor-parallel ranks so, whose routing is the
same: the driver's is returned. A request asking bypasses the prefix cache (its cached positions would
have no routing) and the async lookahead (its rows are read on the host right after its step).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch

from turnout.layers.moe.layer import SparseMoeBlock


@dataclass
class RoutedExpertsChunk:
    """One sample's routing from one step: positions ``first`` .. ``first + ids.shape[0] - 1``."""

    kind: ClassVar[str] = "routed_experts"
    request_id: str
    index: int  # which of the request's samples (its prompt positions are shared by all)
    first: int
    ids: torch.Tensor  # [n, num_moe_layers, top_k] int32

    def array(self):
        return self.ids.cpu().numpy()


class RoutingRecorder:
    """The model's MoE blocks in forward order, and what one step recorded for the requests asking."""

    def __init__(self, model):
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @staticmethod
    def wanted(scheduled, requests) -> list[tuple[object, int, int]]:
        """(the rank's request, first position, first flat row, rows) of each entry (worker/step.py) whose
        request asks for its routing."""
        spans, offset = [], 0
        for s in scheduled:
            req = requests.get(s.req_id)
            if req is not None and req.return_routed_experts:
                spans.append((req, s.start, offset, s.num_query_tokens))
            offset += s.num_query_tokens
        return spans

    @contextmanager
    def record(self):
        """Every MoE block appends its ``topk_ids`` [T, k] to the yielded list during the forward."""
        got: list[torch.Tensor] = []
        for b in self.blocks:
            b.record_routing = got
        try:
            yield got
        finally:
            for b in self.blocks:
                b.record_routing = None

    def chunks(self, got: list[torch.Tensor], spans) -> list[RoutedExpertsChunk]:
        if len(got) != len(self.blocks):  # every MoE layer routes every token once
            raise RuntimeError(f"routing recorded for {len(got)} of {len(self.blocks)} MoE layers")
        ids = torch.stack(got, dim=1).to(torch.int32)  # [T, L, k]
        return [RoutedExpertsChunk(req.request_id, req.index, start, ids[off:off + n])
                for req, start, off, n in spans]

