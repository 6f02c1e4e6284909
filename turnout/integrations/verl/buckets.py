"""verl's colocated weight transport, both ends: named tensors packed into one flat byte buffer per bucket,
the buffer shared once by handle (CUDA IPC on a GPU, a POSIX shared-memory segment where the device has no
IPC), and per bucket one ZMQ message naming where each tensor lies in it.

The wire protocol is verl's (its ``BucketedWeightSender`` sends into ``receive_buckets_rank`` unchanged,
which tests/rl/test_verl_plugin.py checks with verl's own sender): the trainer binds a REQ socket on
``ipc:///tmp/rl-colocate-zmq-<ray job>-replica-<replica>-rank-<local rank>.sock``; the engine rank connects
a REP socket; the first message is the buffer (``reduce_tensor`` handle, or ``{"name", "size"}`` of the
shared-memory segment), then ``{"bucket_meta": {name: {name, shape, dtype, offset, handle}}, "is_last"}``
per bucket, each answered with an empty frame once the rank has written it (a ``handle`` is a tensor too
large for the buffer, shared by itself). The last answer comes after the rank let go of the buffer, so the
trainer may free it at once.

Every bucket is checked against the model (names, shapes) before any of it is written; a bad bucket is
still answered, so the trainer never hangs, and the error is raised once the last bucket arrived.
"""

from __future__ import annotations

import asyncio
import os
from multiprocessing import resource_tracker, shared_memory

import torch

# Each side waits at most this long for the other's next message: a trainer that died must not hold an
# engine rank (and with it the engine thread) forever.
WAIT_S = 300.0


def zmq_handle(job_id: str, replica_rank: int, local_rank: int) -> str:
    """verl's socket name (its ``ServerAdapter`` and vLLM worker extension agree on it the same way)."""
    return f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-{replica_rank}-rank-{local_rank}.sock"


def _rebuild(handle, device: torch.device) -> torch.Tensor:
    rebuild, args = handle
    args = list(args)
    if device.type == "cuda" and len(args) > 6:
        args[6] = device.index if device.index is not None else torch.cuda.current_device()  # this process's
    return rebuild(*args)


def _attach_shm(name: str, size: int):
    shm = shared_memory.SharedMemory(name=name)
    # The trainer owns (and unlinks) the segment: without this, this process's resource tracker would
    # unlink it again at exit and warn about a leak that is not ours.
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - the name the tracker keys on
    except Exception:  # noqa: BLE001 - a tracker that did not register it has nothing to forget
        pass
    return torch.frombuffer(shm.buf[:size], dtype=torch.uint8), shm


def receive_buckets_rank(worker, handles: list[str], use_shm: bool) -> list[str]:
    """Run on every engine rank (``collective_rpc``): receive the trainer's buckets on ``handles[rank]`` and
    write each into this rank's shard. Returns the parameter names written."""
    import zmq

    r = worker.runner
    if r.memory.weights_asleep:
        raise RuntimeError("update_weights: the weights are asleep; wake_up(tags=['weights']) first")
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(handles[worker.rank])
    buffer = shm = None
    written: set[str] = set()
    error: BaseException | None = None

    def recv():
        if not sock.poll(int(WAIT_S * 1000)):
            raise TimeoutError(f"update_weights: no message from the trainer on {handles[worker.rank]} "
                               f"within {WAIT_S:.0f}s")
        return sock.recv_pyobj()

    try:
        first = recv()
        _raise_if_failed(first)
        if use_shm:
            buffer, shm = _attach_shm(first["name"], first["size"])
        else:
            buffer = _rebuild(first, r.device)
        sock.send(b"")
        while True:
            msg = recv()
            _raise_if_failed(msg)
            if error is None:
                try:
                    written |= _write_bucket(r, buffer, msg["bucket_meta"])
                except Exception as e:  # noqa: BLE001 - answered below, raised after the last bucket
                    error = e.with_traceback(None)  # its frames would keep views of the buffer alive
            if msg["is_last"]:
                break
            sock.send(b"")
        buffer = msg = None
        shm = _close(shm)
        sock.send(b"")  # last: the trainer may free its buffer now
    finally:
        buffer = None
        _close(shm)
        sock.close(linger=0)
    if error is not None:
        raise error
    if written:
        r.memory.weights_discarded = False
    return sorted(written)


def _write_bucket(r, buffer, bucket_meta) -> set[str]:
    """One bucket into this rank's shard, all of it or none; its views of the buffer die on return."""
    from turnout.models.weight_map import check_weights, update_weights

    items = []
    for name, meta in bucket_meta.items():
        if meta.get("handle") is not None:  # too large for the buffer: shared by itself
            items.append((name, _rebuild(meta["handle"], r.device)))
            continue
        n = meta["dtype"].itemsize * meta["shape"].numel()
        t = buffer[meta["offset"]:meta["offset"] + n].view(meta["dtype"]).view(meta["shape"])
        items.append((name, t.to(r.device) if t.device != r.device else t))
    check_weights(r.model, items)
    written = update_weights(r.model, items, checked=True)
    if r.device.type == "cuda":
        torch.cuda.synchronize(r.device)  # read before the trainer refills the buffer
    return written


def _close(shm) -> None:
    if shm is not None:
        try:
            shm.close()
        except BufferError:  # a view still alive somewhere: collected with it, the mapping goes too
            import gc

            gc.collect()
            shm.close()
    return None


def _raise_if_failed(msg) -> None:
    """turnout's sender says so when it fails mid-stream (verl's never does), so the rank stops waiting."""
    if isinstance(msg, dict) and "failed" in msg:
        raise RuntimeError(f"update_weights: the trainer's sender failed: {msg['failed']}")


class BucketSender:
    """The trainer's side, for where verl's own sender cannot be imported (it lives in verl's vLLM package,
    which needs vLLM). An asyncio coroutine over ``zmq.asyncio``: waiting for the engine never blocks the
    caller's event loop, and cancelling the task (the engine refused the update) closes the socket."""

    def __init__(self, handle: str, bucket_bytes: int, use_shm: bool):
        if bucket_bytes <= 0:
            raise ValueError(f"update_weights_bucket_megabytes: must be positive, got {bucket_bytes >> 20}")
        self.handle, self.bucket_bytes, self.use_shm = handle, int(bucket_bytes), use_shm

    async def send(self, weights) -> None:
        import zmq
        import zmq.asyncio

        path = self.handle.removeprefix("ipc://")
        if path != self.handle and os.path.exists(path):
            os.remove(path)  # a stale socket file of a crashed run
        sock = zmq.asyncio.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.handle)
        shm = buffer = None
        self._may_send = True  # REQ sockets alternate: a send only after the last answer came
        try:
            if self.use_shm:
                shm = shared_memory.SharedMemory(name=f"turnout_weights_{os.getpid()}_{id(self):x}", create=True,
                                                 size=self.bucket_bytes)
                buffer = torch.frombuffer(shm.buf, dtype=torch.uint8)
                await self._ask(sock, {"name": shm.name, "size": self.bucket_bytes})
            else:
                from torch.multiprocessing.reductions import reduce_tensor

                buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=torch.cuda.current_device())
                await self._ask(sock, reduce_tensor(buffer))
            meta, offset = {}, 0
            async for name, t in _aiter(weights):
                t = t.detach()
                offset = -(-offset // t.element_size()) * t.element_size()  # aligned for its dtype's view
                if offset + t.nbytes > self.bucket_bytes and meta:
                    await self._flush(sock, meta, False)
                    meta, offset = {}, 0
                if t.nbytes > self.bucket_bytes:
                    raise ValueError(f"weights: {name} ({t.nbytes} bytes) exceeds the bucket of {self.bucket_bytes} "
                                     "(rollout.checkpoint_engine.update_weights_bucket_megabytes)")
                buffer[offset:offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
                meta[name] = {"name": name, "shape": t.shape, "dtype": t.dtype, "offset": offset, "handle": None}
                offset += t.nbytes
            await self._flush(sock, meta, True)
        except BaseException as e:
            if self._may_send:  # tell the engine rank, which would otherwise wait for the next bucket
                try:
                    await asyncio.wait_for(sock.send_pyobj({"failed": f"{type(e).__name__}: {e}"}), 5.0)
                except Exception:  # noqa: BLE001 - the engine may be gone too
                    pass
            raise
        finally:
            sock.close(linger=0)
            if path != self.handle and os.path.exists(path):
                os.remove(path)
            buffer = None
            if shm is not None:
                shm.close()
                shm.unlink()

    async def _flush(self, sock, meta, is_last: bool) -> None:
        if torch.cuda.is_available() and not self.use_shm:
            torch.cuda.synchronize()  # the engine reads the buffer from another process
        await self._ask(sock, {"bucket_meta": meta, "is_last": is_last})

    async def _ask(self, sock, obj) -> None:
        await sock.send_pyobj(obj)
        self._may_send = False
        try:
            await asyncio.wait_for(sock.recv(), WAIT_S)
        except asyncio.TimeoutError:
            raise TimeoutError(f"update_weights: the engine did not answer on {self.handle} within "
                               f"{WAIT_S:.0f}s") from None
        self._may_send = True


async def _aiter(weights):
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
