"""A trainer in its own process for tests/rl (spawned): perturbs the checkpoint's weights and shares them with the
engine by handle, in buckets (turnout/worker/weight_ipc.py)."""

from __future__ import annotations

import pickle

import torch


def perturbed(path: str, seed: int):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return hf


def trainer_main(path: str, seed: int, num_buckets: int, conn, device: str = "cpu") -> None:
    """``device`` "cuda": the buffers are on the GPU and the handles CUDA IPC ones."""
    from turnout.worker.weight_ipc import make_bucket

    named = list(perturbed(path, seed).to(device).named_parameters())
    size = -(-len(named) // num_buckets)
    for i in range(0, len(named), size):
        buffer, bucket = make_bucket(named[i:i + size])
        conn.send_bytes(pickle.dumps(bucket))
        assert conn.recv() == "done"  # the engine read it: the buffer may go
        del buffer
    conn.send_bytes(b"")


def bucket_trainer_main(path: str, seed: int, handle: str, bucket_bytes: int, device: str) -> None:
    """verl's bucket protocol, trainer side (turnout/integrations/verl/buckets.py): the perturbed weights from
    ``device`` ("cuda": CUDA IPC buffer; "cpu": a shared-memory segment) in buckets of ``bucket_bytes``."""
    import asyncio

    from turnout.integrations.verl.buckets import BucketSender

    named = list(perturbed(path, seed).to(device).named_parameters())
    asyncio.run(BucketSender(handle, bucket_bytes, use_shm=device == "cpu").send(named))
