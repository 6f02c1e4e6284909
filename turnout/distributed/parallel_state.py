"""Process groups over torch.distributed, with the backend the platform declares (``Platform.dist_backend``:
nccl on CUDA / ROCm, gloo on CPU, the vendor's own elsewhere).

A rank's tensor-parallel place is a ``TPGroup`` (rank, size, torch process group), made once at start-up and
handed to the model constructor, which hands it to every layer: nothing reads it from a global in a hot path.
``current_tp_group()`` exists for the collective ops' default group (``ops.all_reduce(x)`` with no group).

A world of one is ``SINGLE``: no process group at all, and the layers then make no collective call.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass, field
from typing import Any

from turnout.distributed import rendezvous


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group: ``rank`` of ``size``; ``group`` is the torch ProcessGroup (None when
    ``size == 1``: a world of one needs no group)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    backend: str = ""

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size} is not a place in the group")
        if self.size > 1 and self.group is None:
            raise ValueError(f"tensor-parallel size {self.size} needs a process group (init_distributed)")

    @property
    def is_single(self) -> bool:
        return self.size == 1


SINGLE = TPGroup()
_current: TPGroup | None = None


def current_tp_group() -> TPGroup | None:
    """The group ``init_distributed`` made in this process (None before, or after ``destroy_distributed``)."""
    return _current


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (loopback by default: the rendezvous never listens on 0.0.0.0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed(platform, *, rank: int, world_size: int, init_method: str | None = None,
                     tensor_parallel_size: int | None = None, timeout_s: float = 300.0,
                     device=None, collective_timeout_s: float | None = None) -> TPGroup:
    """Join the world (``rank`` of ``world_size``) on the platform's backend and return this rank's TP group.

    ``init_method``: a torch.distributed URL (``tcp://127.0.0.1:PORT``, ``env://``) or a torch ``Store``;
    required for a world of more than one. ``tensor_parallel_size`` (default: the whole world) splits the
    world into groups of that many consecutive ranks. ``device``: this rank's device, for backends that bind
    one (NCCL). A world of one with no ``init_method`` makes no process group and returns ``SINGLE``.
    """
    # timeout_s bounds the rendezvous (ranks start seconds apart); collective_timeout_s (default: the same) is
    # the TP group's own timeout: how long a collective waits for a peer that hangs.
    global _current
    tp = tensor_parallel_size or world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a place in a world of {world_size}")
    if world_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the world size {world_size}")
    if world_size == 1 and init_method is None:
        _current = SINGLE
        return SINGLE
    if init_method is None:
        raise ValueError(f"a world of {world_size} ranks needs an init_method (e.g. tcp://127.0.0.1:PORT)")
    import torch.distributed as dist

    backend = platform.dist_backend
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    kwargs = {}
    if device is not None and backend == "nccl":
        kwargs["device_id"] = device  # binds the communicator to this rank's GPU at once
    if isinstance(init_method, str) and init_method.startswith("tcp://"):
        # rank 0's store listens on the URL's host only (distributed/rendezvous.py), the others join it
        kwargs["store"] = rendezvous.store_for(init_method, rank, timeout_s)
    elif isinstance(init_method, str):
        kwargs["init_method"] = init_method
    else:  # a torch Store made by the caller (rank 0 of a multi-node engine: distributed/rendezvous.py)
        kwargs["store"] = init_method
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    group_kwargs = {}
    if collective_timeout_s is not None and collective_timeout_s != timeout_s:
        group_kwargs["timeout"] = datetime.timedelta(seconds=collective_timeout_s)
    if tp == world_size and not group_kwargs:
        group = dist.group.WORLD
    else:  # every rank must create every group, in the same order (torch.distributed's rule)
        group = None
        for start in range(0, world_size, tp):
            g = dist.new_group(list(range(start, start + tp)), **group_kwargs)
            if start <= rank < start + tp:
                group = g
    _current = TPGroup(rank=rank % tp, size=tp, group=group if tp > 1 else None, backend=backend)
    return _current


def destroy_distributed() -> None:
    """Leave the world (a no-op when this process never joined one)."""
    global _current
    _current = None
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
