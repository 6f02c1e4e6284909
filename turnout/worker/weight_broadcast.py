"""Weights broadcast from a trainer over torch.distributed: the RL transport for a trainer on other GPUs or hosts
than the engine, which sends each new weight once to every engine rank.

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

Every wait is bounded by a timeout its caller sets (``timeout_s``): the rendezvous (the store's and the
group's timeout) and each broadcast. ``wait_for_listener`` is the cheap part of joining that can take long
(the trainer's store not up yet, or never: a wrong port), a plain TCP connect retried until the deadline,
so the engine can run it on a thread of its own and step meanwhile; only once something listens does it
build the group on its ranks. A broadcast that times out leaves the group unusable: it is dropped, and the
trainer and the engine must form a new one.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
TIMEOUT = datetime.timedelta(minutes=10)  # the trainer's side, by default (it waits for the engine)
DEFAULT_TIMEOUT_S = 60.0  # the engine's side: a join or a tensor that takes longer fails, the engine steps on


class WeightGroupTimeout(TimeoutError):
    """The trainer did not answer within the caller's timeout; nothing was joined or written."""


@dataclass(frozen=True)
class TimedOut:
    """A rank's answer when its wait ran out: returned, not raised, so that a multi-process executor's
    driver still reads every rank's reply (a raise on the driver would leave the others' in the pipes)."""

    message: str


def raise_timed_out(results: list) -> list:
    """``results`` of a collective call, or WeightGroupTimeout with the first rank's message."""
    failed = [r for r in results if isinstance(r, TimedOut)]
    if failed:
        raise WeightGroupTimeout(failed[0].message)
    return results


def wait_for_listener(master_address: str, master_port: int, timeout_s: float) -> None:
    """Return once ``master_address:master_port`` accepts a TCP connection (the trainer's store is up);
    WeightGroupTimeout after ``timeout_s`` seconds of refusals. Sends nothing: the store drops the socket."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WeightGroupTimeout(f"master_address: nothing accepted a connection at {master_address}:"
                                     f"{master_port} within timeout={timeout_s:g}s ({last or 'no answer'}); start "
                                     "the trainer's store (rank 0) first, or raise timeout")
        try:
            socket.create_connection((master_address, int(master_port)), timeout=min(left, 5.0)).close()
            return
        except socket.gaierror as e:
            raise ValueError(f"master_address: cannot resolve {master_address!r}: {e.strerror}") from None
        except OSError as e:
            last = e.strerror or type(e).__name__
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


@dataclass(frozen=True)
class WeightGroup:
    group: object  # the backend's ProcessGroup
    store: object  # its TCPStore, which must live as long as the group
    backend: str
    rank: int


def stateless_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
                    device: torch.device | None = None, timeout_s: float | None = None) -> WeightGroup:
    """A process group of ``world_size`` members apart from any default world; rank 0 hosts the store.
    Blocks until every member has joined: at most ``timeout_s`` seconds (default: ``TIMEOUT``), then
    WeightGroupTimeout."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: one of {list(BACKENDS)}, got {backend!r}")
    if not (isinstance(world_size, int) and world_size >= 2 and 0 <= rank < world_size):
        raise ValueError(f"world_size / rank: need 0 <= rank < world_size and world_size >= 2, got rank {rank}, "
                         f"world_size {world_size}")
    timeout = TIMEOUT if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=timeout,
                              wait_for_workers=False)
        prefixed = dist.PrefixStore("turnout-weight-update", store)
        if backend == "gloo":
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            if device is not None:
                torch.cuda.set_device(device)
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    except RuntimeError as e:  # DistError and gloo's errors: the store's connect or the rendezvous timed out
        raise WeightGroupTimeout(f"master_address: the weight-update group at {master_address}:{master_port} "
                                 f"(world_size={world_size}, this rank {rank}) did not form within "
                                 f"{timeout.total_seconds():g}s: {str(e).splitlines()[0]}") from None
    return WeightGroup(group, store, backend, rank)


def broadcast(wg: WeightGroup, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
    """``tensor`` from rank 0 of the group into every member's ``tensor`` (in place); WeightGroupTimeout
    after ``timeout_s`` seconds (default: the group's own timeout)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    if timeout_s is not None:
        opts.timeout = datetime.timedelta(seconds=timeout_s)
    try:
        wg.group.broadcast([tensor], opts).wait()
    except RuntimeError as e:  # DistError and gloo's own: the receive timed out or the peer went away
        raise WeightGroupTimeout(f"timeout: the trainer's broadcast did not arrive within "
                                 f"{'the group timeout' if timeout_s is None else f'{timeout_s:g}s'}: "
                                 f"{str(e).splitlines()[0]}") from None


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
