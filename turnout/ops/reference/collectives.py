"""Collectives as ops: the reference is torch.distributed on the group's backend (the platform's: NCCL, gloo,
HCCL, ...). A custom all-reduce (vendor or Triton) registers as another ``Impl`` of ``all_reduce`` and is
conformance-tested against this one like any kernel.

``group``: a torch ProcessGroup; None is this process's tensor-parallel group (turnout.distributed), or
torch's default group, or, when this process is in no world at all, a world of one. In a world of one every
collective is the identity (that is what the conformance samples exercise on one process); the layers make no
collective call at all there.
"""

from __future__ import annotations

import torch

from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase


def _gather_into(out, x, group) -> None:
    import torch.distributed as dist

    # all_gather_single is torch >= 2.13's name; all_gather_into_tensor the older one (deprecated there).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def _reduce_scatter_into(out, x, group) -> None:
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group)


def _resolve(group):
    """(process group or None, world size) for ``group``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was passed, but torch.distributed is not initialized")
        return None, 1
    if group is None:
        from turnout.distributed.parallel_state import current_tp_group

        tp = current_tp_group()
        if tp is not None and tp.group is not None:
            group = tp.group
        elif tp is not None:  # this process's TP group is a world of one (a rank of a larger world)
            return None, 1
    return group, dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` (contiguous) over the group's ranks, in place; returns ``x``."""
    import torch.distributed as dist

    group, world = _resolve(group)
    if world > 1:
        dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order: [..., n, ...] -> [..., W * n, ...]."""
    group, world = _resolve(group)
    if world == 1:
        return x.clone()
    dim = dim % x.dim()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # ranks along dim 0
    _gather_into(out, x.contiguous(), group)
    if dim == 0:
        return out
    out = out.view(world, *x.shape).movedim(0, dim)  # [..., W, n, ...]
    return out.reshape(*x.shape[:dim], world * x.shape[dim], *x.shape[dim + 1:])


def reduce_scatter(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's slice of ``dim`` (split in W equal parts, rank order)."""
    group, world = _resolve(group)
    dim = dim % x.dim()
    if x.shape[dim] % world:
        raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} does not split in {world} ranks")
    if world == 1:
        return x.clone()
    src = x.movedim(dim, 0).contiguous()  # [W * n, ...]
    out = torch.empty((src.shape[0] // world, *src.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_into(out, src, group)
    return out.movedim(0, dim)


def all_to_all(x: torch.Tensor, group=None, output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None) -> torch.Tensor:
    """Rows of ``x`` (dim 0) sent to the ranks in order (``input_split_sizes`` rows each; None: equal parts);
    returns the rows received, in rank order (``output_split_sizes`` from each; None: equal parts)."""
    import torch.distributed as dist

    group, world = _resolve(group)
    if world == 1:
        for what, sizes in (("input_split_sizes", input_split_sizes), ("output_split_sizes", output_split_sizes)):
            if sizes is not None and list(sizes) != [x.shape[0]]:
                raise ValueError(f"all_to_all: {what} {list(sizes)} in a world of one must be [{x.shape[0]}]")
        return x.clone()
    rows = sum(output_split_sizes) if output_split_sizes is not None else x.shape[0]
    out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
    return out


# Sample inputs run in whatever world the process is in; `turnout ops --check` is one process, a world of one.

def _all_reduce_samples(device, dtype, gen):
    for shape in [(1, 64), (7, 96), (33, 256)]:
        yield SampleCase(f"{shape[0]}x{shape[1]}", (randn(shape, dtype, device, gen),))


def _all_gather_samples(device, dtype, gen):
    for shape, dim in [((1, 64), -1), ((5, 96), -1), ((6, 32), 0), ((2, 3, 16), 1)]:
        yield SampleCase(f"{'x'.join(map(str, shape))}-dim{dim}", (randn(shape, dtype, device, gen),),
                         {"dim": dim})


def _reduce_scatter_samples(device, dtype, gen):
    for shape, dim in [((8, 64), 0), ((4, 96), -1)]:
        yield SampleCase(f"{'x'.join(map(str, shape))}-dim{dim}", (randn(shape, dtype, device, gen),),
                         {"dim": dim})


def _all_to_all_samples(device, dtype, gen):
    for rows in (8, 24):
        yield SampleCase(f"{rows}x32", (randn((rows, 32), dtype, device, gen),))


_EXACT = {"float32": (0.0, 0.0), "float16": (0.0, 0.0), "bfloat16": (0.0, 0.0)}
# A sum over ranks may be taken in another order by another implementation (a ring, a tree, one-shot).
_SUM = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}

ALL_REDUCE = OpSpec("all_reduce", all_reduce, _all_reduce_samples, mutates=("x",), tolerance=_SUM,
                    doc="sum over the group's ranks, in place (row-parallel linears, the vocab-parallel embedding)")
ALL_GATHER = OpSpec("all_gather", all_gather, _all_gather_samples, tolerance=_EXACT,
                    doc="concatenate the ranks' tensors along dim (the vocab-parallel LM head's logits)")
REDUCE_SCATTER = OpSpec("reduce_scatter", reduce_scatter, _reduce_scatter_samples, tolerance=_SUM,
                        doc="sum over the ranks, keep this rank's slice of dim")
ALL_TO_ALL = OpSpec("all_to_all", all_to_all, _all_to_all_samples, tolerance=_EXACT,
                    doc="rows of dim 0 exchanged between the ranks (expert-parallel token dispatch)")
