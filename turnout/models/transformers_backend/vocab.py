"""The token embedding and the LM head of a transformers model as turnout's vocab-parallel layers
(turnout/layers/embedding.py: ``VocabEmbedding``, ``LMHead``).

Under tensor parallelism rank r holds rows [r Vp, (r + 1) Vp) of the embedding and of the head (the last rank's
padded with zero rows); the embedding looks up the ids it holds and sums over the ranks, the head computes its
slice of the logits and all-gathers them, as the native models do. A tied head shares the embedding's weight
(registered once, under the embedding's name). The embedding is replaced where it is a plain ``nn.Embedding``
(a family's own embedding class, one that scales or adds inside, stays transformers code, whole), through the
public ``get_input_embeddings`` / ``set_input_embeddings``; the head where it is a plain ``nn.Linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.embedding import LMHead, VocabEmbedding
from turnout.layers.fusion import NO_FUSIONS, FusionPlan


class TransformersEmbedding(VocabEmbedding):
    """``VocabEmbedding`` for ids of any shape (transformers calls it with [batch, tokens]); keeps the
    attributes modeling code reads from an ``nn.Embedding``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None, *, tp: TPGroup, ops):
        super().__init__(num_embeddings, embedding_dim, tp=tp, ops=ops)
        self.padding_idx = padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().forward(input_ids.reshape(-1))  # [N, H]
        return hidden.view(*input_ids.shape, self.embedding_dim)


def replace_vocab(hf: nn.Module, head_name: str, ops, plan: FusionPlan = NO_FUSIONS,
                  tp: TPGroup = SINGLE) -> tuple[bool, bool]:
    """The embedding and the head (attribute ``head_name`` of the causal LM) of ``hf`` (parameters on the meta
    device) -> turnout's vocab-parallel layers. Returns (embedding replaced, head replaced)."""
    emb = hf.get_input_embeddings()
    head = getattr(hf, head_name, None)
    new_emb = new_head = None
    with torch.device("meta"):  # made real by build.materialize with the rest
        tied = type(head) is nn.Linear and head.weight is emb.weight
        if type(emb) is nn.Embedding and not (tied and head.bias is not None):  # (a tied head with a bias: both stay)
            new_emb = TransformersEmbedding(emb.num_embeddings, emb.embedding_dim, emb.padding_idx, tp=tp, ops=ops)
        if type(head) is nn.Linear and (not tied or (new_emb is not None and head.bias is None)):
            new_head = LMHead(head.out_features, head.in_features, head.bias is not None,
                              tie_to=new_emb if tied else None, tp=tp, ops=ops, plan=plan)
    if new_emb is not None:
        hf.set_input_embeddings(new_emb)
    if new_head is not None:
        setattr(hf, head_name, new_head)
    return new_emb is not None, new_head is not None
