"""Linear layers with per-parameter weight loaders (vLLM style).

Every parameter carries ``param.weight_loader(param, loaded_weight, shard_id=None)``; the generic
walker in ``turnout.loader.weight_map`` calls it with each checkpoint tensor. Packed layers
(``QKVParallelLinear``, ``MergedColumnParallelLinear``) also carry ``param.shard_ids``, the shards the
walker must see before the parameter counts as loaded.

Tensor parallelism: the loaders already take this rank's slice of a full checkpoint tensor
(``tp_rank`` of ``tp_size``; column layers split the output dim, row layers the input dim). Only
``tp_size=1`` runs today; the all-reduce after a row layer is the distributed layer's job.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch{' for ' + what if what else ''}: checkpoint tensor "
                         f"{tuple(loaded.shape)}, parameter expects {tuple(param.shape)}")


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Copy a whole tensor (any dtype/device) into ``param`` after checking the shape."""
    if shard_id is not None:
        raise ValueError(f"unexpected shard {shard_id!r} for an unpacked parameter")
    _check_shape(param, loaded_weight)
    param.data.copy_(loaded_weight)


def _param(*shape: int) -> nn.Parameter:
    # Built under the loader's device and default dtype; filled by the weight loaders.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, small_m) -> torch.Tensor:
    """F.linear, or the ``small_m_linear`` op for a one-row input when a model was given it. ``x`` may also be
    a norm not yet computed (``turnout.layers.norm.PendingNorm``), which this projection may fuse."""
    if not isinstance(x, torch.Tensor):
        return x.project(weight, bias, small_m)
    if small_m is not None and x.dim() == 2 and x.shape[0] == 1:
        return small_m(x, weight, bias)
    return F.linear(x, weight, bias)


class LinearBase(nn.Module):
    """y = x W^T (+ b); ``weight`` [out_local, in_local]."""

    small_m = None  # the small_m_linear op for one-row inputs (``use_small_m_linear``); None: F.linear

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = _param(*self.local_shape(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(self.local_shape(output_size, input_size)[0])
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def local_shape(self, out: int, inp: int) -> tuple[int, int]:
        return out, inp

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.small_m)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """The full weight on every rank (small projections, routers)."""


def _split(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what} {size} is not divisible by tensor-parallel size {tp_size}")
    return size // tp_size


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks: rank r holds rows [r*out/tp, (r+1)*out/tp)."""

    def local_shape(self, out, inp):
        return _split(out, self.tp_size, "output size"), inp

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for an unpacked parameter")
        rows = param.shape[0]
        if loaded_weight.shape[0] != rows * self.tp_size:
            _check_shape(torch.empty(rows * self.tp_size, *param.shape[1:], device="meta"), loaded_weight)
        default_weight_loader(param, loaded_weight.narrow(0, self.tp_rank * rows, rows))


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; partial sums are reduced by the caller. Bias is whole."""

    def local_shape(self, out, inp):
        return out, _split(inp, self.tp_size, "input size")

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if param.dim() == 1 or self.tp_size == 1:  # bias, or nothing to split
            return default_weight_loader(param, loaded_weight, shard_id)
        cols = param.shape[1]
        if loaded_weight.dim() != 2 or loaded_weight.shape[1] != cols * self.tp_size:
            _check_shape(torch.empty(param.shape[0], cols * self.tp_size, device="meta"), loaded_weight)
        default_weight_loader(param, loaded_weight.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x):
        # With tp_size > 1 only rank 0 adds the bias, so the reduced sum carries it once.
        bias = self.bias if self.tp_rank == 0 else None
        return project(x, self.weight, bias, self.small_m)


class _PackedColumnLinear(ColumnParallelLinear):
    """Several column projections stored as one weight; each checkpoint shard loads into its rows."""

    def __init__(self, input_size: int, shard_sizes: dict, bias: bool, tp_rank: int = 0, tp_size: int = 1):
        self.shard_sizes = dict(shard_sizes)  # shard id -> full (all ranks) output size
        super().__init__(input_size, sum(self.shard_sizes.values()), bias, tp_rank, tp_size)
        self.shard_offsets, off = {}, 0  # shard id -> (local offset, local size)
        for sid, size in self.shard_sizes.items():
            local = _split(size, tp_size, f"shard {sid!r} size")
            self.shard_offsets[sid] = (off, local)
            off += local
        for p in self.parameters(recurse=False):
            p.shard_ids = tuple(self.shard_sizes)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:  # a checkpoint that already stores the packed tensor
            if self.tp_size != 1:
                raise ValueError("a pre-packed checkpoint tensor cannot be split across ranks")
            return default_weight_loader(param, loaded_weight)
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; this layer packs {list(self.shard_offsets)}")
        off, size = self.shard_offsets[shard_id]
        full = self.shard_sizes[shard_id]
        if loaded_weight.shape[0] != full or loaded_weight.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch for shard {shard_id!r}: checkpoint tensor "
                             f"{tuple(loaded_weight.shape)}, parameter expects "
                             f"{(full, *param.shape[1:])}")
        param.data.narrow(0, off, size).copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(_PackedColumnLinear):
    """Projections of sizes ``output_sizes`` from the same input, shards 0, 1, ... (e.g. gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1):
        super().__init__(input_size, dict(enumerate(output_sizes)), bias, tp_rank, tp_size)


class QKVParallelLinear(_PackedColumnLinear):
    """Fused q/k/v projection, shards "q", "k", "v"; output [T, (Hq + 2 Hk) * D] on one rank.

    With more ranks than kv heads a real TP build replicates kv heads; that is not supported yet.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        self.head_dim = head_dim
        self.num_heads = _split(total_num_heads, tp_size, "num_heads")
        self.num_kv_heads = _split(total_num_kv_heads, tp_size, "num_kv_heads")
        super().__init__(hidden_size, {"q": total_num_heads * head_dim, "k": total_num_kv_heads * head_dim,
                                       "v": total_num_kv_heads * head_dim}, bias, tp_rank, tp_size)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def use_k_major_weights(model: nn.Module) -> int:
    """Store every linear weight [N, K] as the transposed view of a contiguous [K, N] tensor.

    Semantics are unchanged (``F.linear`` sees the same [N, K] values), but on CPU BLAS runs
    30-40 % faster on the skinny GEMMs of decoding with this layout (measured on AVX-512 Xeons, M = 32).
    Embedding tables are left alone (a tied LM head shares them and row gathers want rows contiguous).
    Returns the number of weights changed.
    """
    from turnout.layers.embedding import LMHead, VocabEmbedding

    shared = {id(m.weight) for m in model.modules() if isinstance(m, VocabEmbedding)}
    changed = 0
    for mod in model.modules():
        if isinstance(mod, (LinearBase, LMHead)) and mod.weight.dim() == 2 and id(mod.weight) not in shared:
            mod.weight.data = mod.weight.data.t().contiguous().t()
            changed += 1
    return changed


def use_small_m_linear(model: nn.Module, op) -> int:
    """Run every linear layer, MoE router and LM head through ``op`` (the ``small_m_linear`` op) for
    one-row inputs.

    At batch-1 decode each projection is a weight stream; on the H200 the Triton kernel reads it at or
    above cuBLAS's rate on every projection of Qwen3-8B and Qwen3-30B-A3B (docs/benchmarks.md). Beyond one
    row, F.linear. Returns the number of modules changed.
    """
    from turnout.layers.embedding import LMHead
    from turnout.layers.moe.layer import Router

    changed = 0
    for mod in model.modules():
        if isinstance(mod, (LinearBase, LMHead, Router)):
            mod.small_m = op
            changed += 1
    return changed


def use_fused_prenorm(model: nn.Module, op, when=None) -> int:
    """Let every decoder layer of ``model`` fuse its two pre-norms into the projections that read them at
    batch-1 decode, through ``op`` (the ``add_rms_norm_linear`` op; None turns it off again), for the
    projection shapes where ``when(N, K)`` is true (None: all). Only with ``use_small_m_linear``: the fused
    kernel is the one-row projection's. Returns the number of layers."""
    changed = 0
    for mod in model.modules():
        if hasattr(mod, "prenorm_linear"):
            mod.prenorm_linear = op
            mod.prenorm_when = when
            changed += 1
    return changed

