"""Weights broadcast from a trainer over torch.distributed (the disaggregated transport of issue 20).

The trainer's rank and every engine rank form a group of their own, apart from the engine's tensor-parallel
group: a process can hold one default torch.distributed world only, and the engine's ranks may be in one
already. So the group is built directly from a ``TCPStore`` (the trainer's, at ``master_address:master_port``)
and the backend's process-group class (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), never through
``init_process_group``. Ranks: the trainer 0, engine rank r ``rank_offset + r``.

``update_weights_from_distributed(names, dtypes, shapes)``: every engine rank receives each tensor, in that
order, from rank 0 (the trainer broadcasts the same list, ``broadcast_weights`` below), then writes them
through the weight map like any update. The engine checks the names and shapes against its model before
any rank receives, so a list that does not fit is a ValueError with nothing received or written (the
trainer's broadcasts then wait for a receiver: the caller sees the error and must not send).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class WeightGroup:
    group: object  # the backend's ProcessGroup
    store: object  # its TCPStore, which must live as long as the group
    backend: str
    rank: int


def stateless_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
                    device: torch.device | None = None) -> WeightGroup:
    """A process group of ``world_size`` members apart from any default world; rank 0 hosts the store.
    Blocks until every member has joined."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: one of {list(BACKENDS)}, got {backend!r}")
    if not (isinstance(world_size, int) and world_size >= 2 and 0 <= rank < world_size):
        raise ValueError(f"world_size / rank: need 0 <= rank < world_size and world_size >= 2, got rank {rank}, "
                         f"world_size {world_size}")
    store = dist.TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=TIMEOUT,
                          wait_for_workers=False)
    prefixed = dist.PrefixStore("turnout-weight-update", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, TIMEOUT)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = TIMEOUT
        if device is not None:
            torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    return WeightGroup(group, store, backend, rank)


def broadcast(wg: WeightGroup, tensor: torch.Tensor) -> None:
    """``tensor`` from rank 0 of the group into every member's ``tensor`` (in place)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    wg.group.broadcast([tensor], opts).wait()


def broadcast_weights(wg: WeightGroup, named_tensors) -> None:
    """The trainer's side: each tensor, in order, from rank 0 (its contiguous copy)."""
    for _, t in named_tensors:
        broadcast(wg, t.detach().contiguous())


def parse_dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    if isinstance(d, str):
        dt = getattr(torch, d.removeprefix("torch."), None)
        if isinstance(dt, torch.dtype):
            return dt
    raise ValueError(f"dtypes: {d!r} is not a torch dtype (e.g. torch.bfloat16 or 'bfloat16')")


def meta_weights(names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
    """The announced tensors as meta tensors (for the up-front check). ValueError naming the field."""
    names, dtypes, shapes = list(names), list(dtypes), list(shapes)
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes, shapes: lengths differ ({len(names)}, {len(dtypes)}, {len(shapes)})")
    out = []
    for n, d, s in zip(names, dtypes, shapes):
        if not isinstance(n, str):
            raise ValueError(f"names: {n!r} is not a string")
        try:
            shape = tuple(int(x) for x in s)
        except (TypeError, ValueError):
            raise ValueError(f"shapes: {s!r} (for {n!r}) is not a sequence of ints") from None
        out.append((n, torch.empty(shape, dtype=parse_dtype(d), device="meta")))
    return out
