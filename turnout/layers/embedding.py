"""Token embedding and the LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.linear import one_row_path, project
from turnout.layers.weights import default_weight_loader


class VocabEmbedding(nn.Module):
    """input_ids [T] int64 -> [T, H]. ``weight`` [V, H]."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """hidden [N, H] -> logits [N, V] float32.

    ``tie_to``: share the embedding's weight (``tie_word_embeddings``). The shared parameter is then
    registered once, under the embedding's name, so a checkpoint's redundant ``lm_head.weight`` is
    an ignorable extra, not a second parameter to fill. ``ops`` and ``plan``: as for the linear layers
    (with ``plan.one_row_linear`` a one-row batch goes through ``ops.small_m_linear``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 tie_to: VocabEmbedding | None = None, *, ops=None, plan: FusionPlan = NO_FUSIONS):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tied = tie_to is not None
        if tie_to is not None:
            if tuple(tie_to.weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"cannot tie an LM head of {(num_embeddings, embedding_dim)} to an "
                                 f"embedding of {tuple(tie_to.weight.shape)}")
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
            self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(num_embeddings), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)
        self.one_row_ops, _ = one_row_path(ops, plan, num_embeddings, embedding_dim)  # never given a pending norm

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32; with ``out`` (float32 [N, V]) written there, the cast and the
        store in one kernel (a captured decode step writes its static logits buffer so)."""
        logits = project(hidden, self.weight, self.bias, self.one_row_ops)
        if out is None:
            return logits.float()
        return out.copy_(logits)

    def extra_repr(self) -> str:
        return f"{self.embedding_dim} -> {self.num_embeddings}, tied={self.tied}"
