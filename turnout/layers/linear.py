"""Linear layers with per-parameter weight loaders (vLLM style).

Every parameter carries ``param.weight_loader(param, loaded_weight, shard_id=None)``; the generic
walker in ``turnout.models.weight_map`` calls it with each checkpoint tensor. Packed layers
(``QKVParallelLinear``, ``MergedColumnParallelLinear``) also carry ``param.shard_ids``, the shards the
walker must see before the parameter counts as loaded.

Tensor parallelism (``tp``: this rank's ``TPGroup``, turnout/distributed): each loader takes this rank's
slice of a full checkpoint tensor (column layers split the output dim, row layers the input dim, packed
layers each packed part: rank r holds its share of q, of k, of v, of gate, of up). A row-parallel layer sums
its partial products with ``ops.all_reduce`` over the group. In a world of one (``SINGLE``, the default)
nothing is split and no collective is called: the layers are exactly the single-device ones.

Quantisation (``plan.linear_quant``, e.g. turnout/quant/fp8.py): a layer that is ``quantizable`` (not the
replicated ones: routers, latent projections) lets the method create its parameters and runs its forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.weights import check_shape as _check_shape
from turnout.layers.weights import default_weight_loader


def _param(*shape: int) -> nn.Parameter:
    # Built under the loader's device and default dtype; filled by the weight loaders.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def project(x, weight: torch.Tensor, bias: torch.Tensor | None, one_row_ops=None,
            takes_norm: bool = False, linear_ops=None) -> torch.Tensor:
    """x W^T (+ b): ``F.linear``, or for a one-row ``x`` the ``small_m_linear`` op of ``one_row_ops`` (the op
    table, where the fusion plan routes one-row projections through it; None: never).

    ``x`` may also be a pre-norm not computed yet (``turnout.layers.norm.PendingNorm``). A projection that
    ``takes_norm`` (the plan fuses the norm into projections of its shape) lets it compute the norm inside
    this projection's kernel; any other takes the normed tensor. ``linear_ops``: the op table whose ``linear``
    op takes every projection (``plan.all_linear``, batch-invariant mode; None: ``F.linear``)."""
    if not isinstance(x, torch.Tensor):
        y = x.fused_projection(weight, bias) if takes_norm else None
        if y is not None:
            return y
        x = x.tensor()
    if one_row_ops is not None and x.dim() == 2 and x.shape[0] == 1:
        return one_row_ops.small_m_linear(x, weight, bias)
    if linear_ops is not None:
        return linear_ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class LinearBase(nn.Module):
    """y = x W^T (+ b); ``weight`` [out_local, in_local].

    ``ops`` and ``plan`` (turnout/layers/fusion.py) choose the one-row path when the layer is built: with
    ``plan.one_row_linear`` one-row inputs go through ``ops.small_m_linear``, and the layer takes a pending
    pre-norm into its own kernel where ``plan.fuses_prenorm`` says so for its weight shape."""

    quantizable = True  # plan.linear_quant applies (False: kept in the compute dtype)

    def __init__(self, input_size: int, output_size: int, bias: bool, *, tp: TPGroup = SINGLE, ops=None,
                 plan: FusionPlan = NO_FUSIONS):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.weight = _param(*self.local_shape(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(self.local_shape(output_size, input_size)[0])
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.quant = plan.linear_quant if self.quantizable else None
        if self.quant is not None:  # its own parameters and forward; no one-row fusion of float weights
            self.quant.create_weights(self, ops)
            self.one_row_ops, self.takes_norm = None, False
        else:
            self.one_row_ops, self.takes_norm = one_row_path(ops, plan, *self.weight.shape)
        self.linear_ops = all_rows_path(ops, plan)

    def local_shape(self, out: int, inp: int) -> tuple[int, int]:
        return out, inp

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(x, self.bias)

    def _project(self, x, bias):
        if self.quant is not None:
            return self.quant.apply(self, x if isinstance(x, torch.Tensor) else x.tensor(), bias)
        return project(x, self.weight, bias, self.one_row_ops, self.takes_norm, self.linear_ops)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


def one_row_path(ops, plan: FusionPlan, n: int, k: int):
    """(op table for one-row projections or None, whether a pending pre-norm is computed inside this
    projection) for a projection with weight [n, k] under ``plan``."""
    if not plan.one_row_linear:
        return None, False
    if ops is None:
        raise ValueError("a fusion plan with one_row_linear needs the op table (ops=...)")
    return ops, plan.fuses_prenorm(n, k)


def all_rows_path(ops, plan: FusionPlan):
    """The op table whose ``linear`` op takes every projection (``plan.all_linear``), or None."""
    if not plan.all_linear:
        return None
    if ops is None:
        raise ValueError("a fusion plan with all_linear needs the op table (ops=...)")
    return ops


class ReplicatedLinear(LinearBase):
    """The full weight on every rank (small projections, routers); never quantised."""

    quantizable = False

    def local_shape(self, out, inp):  # whole on every rank, whatever its group
        return out, inp


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
    """Input dim split across ranks; the partial products are summed over the group (``ops.all_reduce``) unless
    ``reduce_results=False`` (a caller that reduces later itself). Bias is whole, added once (rank 0)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, *, tp: TPGroup = SINGLE, ops=None,
                 plan: FusionPlan = NO_FUSIONS, reduce_results: bool = True):
        super().__init__(input_size, output_size, bias, tp=tp, ops=ops, plan=plan)
        # Decided here, once: in a world of one the forward is the plain projection, no collective call.
        self.reduce_ops = ops if reduce_results and tp.size > 1 else None
        if reduce_results and tp.size > 1 and ops is None:
            raise ValueError("a row-parallel linear over several ranks needs the op table (ops=...)")

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
        y = self._project(x, bias)
        if self.reduce_ops is not None:
            y = self.reduce_ops.all_reduce(y, self.tp.group)  # [T, out], summed over the ranks, in place
        return y


class _PackedColumnLinear(ColumnParallelLinear):
    """Several column projections stored as one weight; each checkpoint shard loads into its rows.

    Under tensor parallelism every packed part is split on its own (rank r holds its share of each part,
    back to back), so that a rank's q, k and v, or gate and up, stay adjacent in its local weight."""

    def __init__(self, input_size: int, shard_sizes: dict, bias: bool, *, tp: TPGroup = SINGLE, ops=None,
                 plan: FusionPlan = NO_FUSIONS):
        self.shard_sizes = dict(shard_sizes)  # shard id -> full (all ranks) output size
        self.shard_offsets, self.shard_starts, off = {}, {}, 0  # shard id -> (local offset, local size); source row
        for sid, size in self.shard_sizes.items():
            start, local = self.shard_slice(sid, size, tp)
            self.shard_offsets[sid] = (off, local)
            self.shard_starts[sid] = start
            off += local
        super().__init__(input_size, sum(self.shard_sizes.values()), bias, tp=tp, ops=ops, plan=plan)
        for p in self.parameters(recurse=False):
            p.shard_ids = tuple(self.shard_sizes)

    def shard_slice(self, sid, size: int, tp: TPGroup) -> tuple[int, int]:
        """(first row of the full part ``sid`` this rank holds, how many rows)."""
        local = _split(size, tp.size, f"shard {sid!r} size")
        return tp.rank * local, local

    def local_shape(self, out, inp):
        return sum(size for _, size in self.shard_offsets.values()), inp

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:  # a checkpoint that already stores the packed tensor (Phi-3's qkv_proj, gate_up_proj)
            if self.tp_size == 1:
                return default_weight_loader(param, loaded_weight)
            # under TP each part is split on its own: cut the full tensor into its parts, in packing order
            total = sum(self.shard_sizes.values())
            if loaded_weight.shape[0] != total or loaded_weight.shape[1:] != param.shape[1:]:
                raise ValueError(f"shape mismatch for the packed tensor: checkpoint tensor "
                                 f"{tuple(loaded_weight.shape)}, expected {(total, *param.shape[1:])} "
                                 f"(parts {dict(self.shard_sizes)})")
            start = 0
            for sid, size in self.shard_sizes.items():
                self.weight_loader(param, loaded_weight.narrow(0, start, size), sid)
                start += size
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; this layer packs {list(self.shard_offsets)}")
        off, size = self.shard_offsets[shard_id]
        full = self.shard_sizes[shard_id]
        if loaded_weight.shape[0] != full or loaded_weight.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch for shard {shard_id!r}: checkpoint tensor "
                             f"{tuple(loaded_weight.shape)}, parameter expects "
                             f"{(full, *param.shape[1:])}")
        param.data.narrow(0, off, size).copy_(loaded_weight.narrow(0, self.shard_starts[shard_id], size))


class MergedColumnParallelLinear(_PackedColumnLinear):
    """Projections of sizes ``output_sizes`` from the same input, shards 0, 1, ... (e.g. gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *, tp: TPGroup = SINGLE,
                 ops=None, plan: FusionPlan = NO_FUSIONS):
        super().__init__(input_size, dict(enumerate(output_sizes)), bias, tp=tp, ops=ops, plan=plan)


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads a rank holds: its share, or one replicated head when there are more ranks than kv heads."""
    if tp_size <= total_num_kv_heads:
        return _split(total_num_kv_heads, tp_size, "num_kv_heads")
    if tp_size % total_num_kv_heads:
        raise ValueError(f"tensor-parallel size {tp_size} is neither a divisor nor a multiple of num_kv_heads "
                         f"{total_num_kv_heads}")
    return 1


class QKVParallelLinear(_PackedColumnLinear):
    """Fused q/k/v projection, shards "q", "k", "v"; output [T, (Hq + 2 Hk) * D] on one rank.

    Under TP each rank holds Hq / tp query heads and Hk / tp kv heads; with more ranks than kv heads
    (tp a multiple of Hk) each rank holds one kv head, replicated on tp / Hk ranks: rank r the head
    r // (tp / Hk), which is the kv head its query heads attend with in the full model.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, *, tp: TPGroup = SINGLE, ops=None, plan: FusionPlan = NO_FUSIONS):
        self.head_dim = head_dim
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _split(total_num_heads, tp.size, "num_heads")
        self.num_kv_heads = kv_heads_per_rank(total_num_kv_heads, tp.size)
        super().__init__(hidden_size, {"q": total_num_heads * head_dim, "k": total_num_kv_heads * head_dim,
                                       "v": total_num_kv_heads * head_dim}, bias, tp=tp, ops=ops, plan=plan)

    def shard_slice(self, sid, size, tp):
        if sid == "q" or tp.size <= self.total_num_kv_heads:
            return super().shard_slice(sid, size, tp)
        replicas = tp.size // self.total_num_kv_heads
        return (tp.rank // replicas) * self.head_dim, self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
