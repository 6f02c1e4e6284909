"""Token embedding and the LM head (optionally tied to the embedding), vocab-parallel under TP.

Under tensor parallelism (``tp``, turnout/distributed) the vocabulary is split in ``tp.size`` equal row ranges
(the last padded with zero rows when the vocabulary does not divide): rank r holds rows [r Vp, (r + 1) Vp) of
the embedding and of the head. The embedding looks up the ids in its range, zeroes the others and sums over
the ranks (``ops.all_reduce``); the head computes its slice of the logits and ``ops.all_gather``s them, so
every rank holds the whole [N, V] row. In a world of one both are the plain single-device layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.linear import all_rows_path, one_row_path, project
from turnout.layers.weights import check_shape, default_weight_loader


def vocab_rows_per_rank(vocab: int, tp_size: int) -> int:
    return -(-vocab // tp_size)


def _vocab_shard_loader(layer):
    """A loader copying rank ``layer.tp.rank``'s rows of a full [V, ...] tensor, zero rows past V."""

    def load(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if layer.tp.size == 1:
            return default_weight_loader(param, loaded_weight, shard_id)
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for an unpacked parameter")
        check_shape(torch.empty(layer.num_embeddings, *param.shape[1:], device="meta"), loaded_weight)
        start = layer.vocab_start
        rows = max(0, min(param.shape[0], layer.num_embeddings - start))
        param.data.narrow(0, 0, rows).copy_(loaded_weight.narrow(0, start, rows))
        param.data.narrow(0, rows, param.shape[0] - rows).zero_()  # padding rows: never looked up, logits cut

    return load


class VocabEmbedding(nn.Module):
    """input_ids [T] int64 -> [T, H]. ``weight`` [V, H] (this rank's [Vp, H] under TP).

    ``scale`` (Gemma: sqrt(H)): every row is multiplied by it, the factor first rounded to the model dtype as
    HF rounds it (a bf16 Gemma multiplies by bf16(sqrt(H)), not by the exact root)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TPGroup = SINGLE, ops=None,
                 scale: float | None = None):
        super().__init__()
        # a derived constant, not in the state dict; in the default (model) dtype the layer is built under
        self.register_buffer("scale", None if scale is None else torch.tensor(float(scale)).to(torch.get_default_dtype()),
                             persistent=False)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp = tp
        rows = vocab_rows_per_rank(num_embeddings, tp.size)
        self.vocab_start = tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        self.weight.weight_loader = _vocab_shard_loader(self) if tp.size > 1 else default_weight_loader
        if tp.size > 1 and ops is None:
            raise ValueError("a vocab-parallel embedding over several ranks needs the op table (ops=...)")
        self.reduce_ops = ops if tp.size > 1 else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.reduce_ops is None:
            hidden = F.embedding(input_ids, self.weight)
        else:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.weight.shape[0])  # [T] ids another rank holds
            hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
            hidden.masked_fill_(outside[:, None], 0.0)
            hidden = self.reduce_ops.all_reduce(hidden, self.tp.group)
        return hidden if self.scale is None else hidden.mul_(self.scale)

    def extra_repr(self) -> str:
        tp = f", rows {self.vocab_start}+{self.weight.shape[0]} of tp {self.tp.size}" if self.tp.size > 1 else ""
        scale = f", scale={self.scale.item():g}" if self.scale is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{tp}{scale}"


class LMHead(nn.Module):
    """hidden [N, H] -> logits [N, V] float32.

    ``tie_to``: share the embedding's weight (``tie_word_embeddings``). The shared parameter is then
    registered once, under the embedding's name, so a checkpoint's redundant ``lm_head.weight`` is
    an ignorable extra, not a second parameter to fill. ``ops`` and ``plan``: as for the linear layers
    (with ``plan.one_row_linear`` a one-row batch goes through ``ops.small_m_linear``, on this rank's rows
    under TP). ``tp``: the vocab split of the module docstring. ``softcap`` (Gemma 2's
    ``final_logit_softcapping``): logits = softcap * tanh(logits / softcap), on the float32 logits.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 tie_to: VocabEmbedding | None = None, *, tp: TPGroup = SINGLE, ops=None,
                 plan: FusionPlan = NO_FUSIONS, softcap: float | None = None):
        super().__init__()
        self.softcap = float(softcap) if softcap else None
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp = tp
        rows = vocab_rows_per_rank(num_embeddings, tp.size)
        self.vocab_start = tp.rank * rows
        self.tied = tie_to is not None
        loader = _vocab_shard_loader(self) if tp.size > 1 else default_weight_loader
        if tie_to is not None:
            if (tie_to.num_embeddings, tie_to.embedding_dim) != (num_embeddings, embedding_dim) or tie_to.tp != tp:
                raise ValueError(f"cannot tie an LM head of {(num_embeddings, embedding_dim)} to an "
                                 f"embedding of {(tie_to.num_embeddings, tie_to.embedding_dim)}")
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
            self.weight.weight_loader = loader
        if bias:
            self.bias = nn.Parameter(torch.empty(rows), requires_grad=False)
            self.bias.weight_loader = loader
        else:
            self.register_parameter("bias", None)
        self.one_row_ops, _ = one_row_path(ops, plan, rows, embedding_dim)  # never given a pending norm
        self.linear_ops = all_rows_path(ops, plan)
        if tp.size > 1 and ops is None:
            raise ValueError("a vocab-parallel LM head over several ranks needs the op table (ops=...)")
        self.gather_ops = ops if tp.size > 1 else None

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32; with ``out`` (float32 [N, V]) written there, the cast and the
        store in one kernel (a captured decode step writes its static logits buffer so)."""
        logits = project(hidden, self.weight, self.bias, self.one_row_ops, linear_ops=self.linear_ops)  # [N, V] (this rank's [N, Vp] under TP)
        if self.gather_ops is not None:
            logits = self.gather_ops.all_gather(logits, -1, self.tp.group)[:, :self.num_embeddings]  # [N, V]
        logits = logits.float() if out is None else out.copy_(logits)
        if self.softcap is not None:  # in place on float32 logits this layer owns (a fresh tensor, or out)
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def extra_repr(self) -> str:
        cap = f", softcap={self.softcap}" if self.softcap is not None else ""
        return f"{self.embedding_dim} -> {self.num_embeddings}, tied={self.tied}{cap}"
