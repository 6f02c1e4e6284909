"""Weights shared by handle from another process, in buckets: the RL transport for a trainer on the same machine
as the engine, which hands new weights over without copying them through the host or pickling their data.

The trainer packs named tensors into one flat byte buffer on its device (``make_bucket``) and sends the
bucket: the buffer's handle (``torch.multiprocessing.reductions.reduce_tensor``, a picklable ``(rebuild,
args)`` pair: a CUDA IPC handle for a GPU tensor, a shared-memory descriptor for a host one) and where each
tensor lies in it. Every engine rank maps the buffer it is given (``update_weights_from_ipc(buckets)``:
one bucket per engine rank, the trainer's tensors on that rank's GPU), takes views of it and writes them
through the weight map: no copy through the host, no pickling of tensor data. The trainer keeps the buffer
alive until the call returns (the engine synchronises before returning), then may reuse it for the next
bucket: a model goes over in buckets of bounded size, so neither side holds a second full copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 256  # bytes: every tensor starts aligned in the buffer (any dtype's view is then legal and fast)


@dataclass(frozen=True)
class IPCBucket:
    handle: tuple  # reduce_tensor(buffer): (rebuild function, its arguments)
    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # "float32", "bfloat16", ...
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # byte offset of each tensor in the buffer


def make_bucket(named_tensors) -> tuple[torch.Tensor, IPCBucket]:
    """The trainer's side: (the flat uint8 buffer, which the caller keeps alive while the engine reads it;
    the bucket to send). The tensors must share a device."""
    from torch.multiprocessing.reductions import reduce_tensor

    named = [(n, t.detach()) for n, t in named_tensors]
    if not named:
        raise ValueError("named_tensors: an empty bucket")
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        raise ValueError(f"named_tensors: one device a bucket, got {sorted(map(str, devices))}")
    offsets, off = [], 0
    for _, t in named:
        offsets.append(off)
        off += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buffer = torch.empty(off, dtype=torch.uint8, device=devices.pop())
    for (_, t), o in zip(named, offsets):
        nbytes = t.numel() * t.element_size()
        buffer[o:o + nbytes].view(t.dtype).view(t.shape).copy_(t)
    if buffer.is_cuda:
        torch.cuda.current_stream(buffer.device).synchronize()  # the engine reads it from another process
    else:
        buffer.share_memory_()
    bucket = IPCBucket(reduce_tensor(buffer), tuple(n for n, _ in named),
                       tuple(str(t.dtype).removeprefix("torch.") for _, t in named),
                       tuple(tuple(t.shape) for _, t in named), tuple(offsets))
    return buffer, bucket


def check_bucket(bucket) -> None:
    if not isinstance(bucket, IPCBucket):
        raise ValueError(f"buckets: each an IPCBucket (turnout.worker.weight_ipc.make_bucket), got "
                         f"{type(bucket).__name__}")
    n = len(bucket.names)
    if not (len(bucket.dtypes) == len(bucket.shapes) == len(bucket.offsets) == n):
        raise ValueError("buckets: names, dtypes, shapes and offsets differ in length")


def open_bucket(bucket: IPCBucket, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The engine rank's side: (name, view into the shared buffer) for every tensor of the bucket."""
    from turnout.worker.weight_broadcast import parse_dtype

    rebuild, args = bucket.handle
    buffer = rebuild(*args)
    if buffer.device.type != device.type or (device.index is not None and buffer.device != device):
        raise ValueError(f"buckets: a bucket on {buffer.device} was given to the engine rank on {device}")
    out = []
    for name, d, shape, off in zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.offsets):
        dtype = parse_dtype(d)
        nbytes = dtype.itemsize * _numel(shape)
        out.append((name, buffer[off:off + nbytes].view(dtype).view(shape)))
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
