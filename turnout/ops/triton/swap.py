"""One layer's KV block swap as one kernel that reads and writes pinned host memory directly.

A GPU addresses pinned (page-locked) host memory through unified virtual addressing: the Triton launcher
turns a pinned CPU tensor's pointer into the device pointer that maps it (and refuses a pageable one), so
the kernel gathers blocks from wherever they are and stores them wherever they go, over PCIe, in one
launch per layer (k and v together) whatever the number of blocks or how scattered they are. The DMA path
(vendor.cuda: one ``cudaMemcpyAsync`` per run of consecutive blocks, per tensor) issues one call per
scattered block per layer per k/v from the host thread that also launches the forward: thousands for a
prefix-tier hit (docs/benchmarks.md, 2026-12-02: "KV tiers"). A side-stream launch of this kernel overlaps the
forward like the DMA would, through the same per-layer events.

Each program copies one chunk of one block of k or v, in the cache's own element type (fp8 as bytes).
Sides that are not pinned host memory or the GPU (a pageable CPU tensor, CPU-only runs) go through the
gather / copy / scatter path of ``cache.swap_blocks``; under TRITON_INTERPRET=1 both sides are CPU memory
and this kernel runs as written.
"""

import weakref

import torch
import triton
import triton.language as tl

from turnout.ops.kv_cache import FP8_KV
from turnout.ops.triton.cache import _triton_runs_on, swap_blocks

CHUNK = 4096  # elements per program: 8 KiB of bf16, four 16-byte accesses per thread at 4 warps


@triton.jit
def _swap_layer_kernel(SRC_K, SRC_V, DST_K, DST_V, MAP, block_numel, chunks, BLOCK: tl.constexpr):
    """DST[map[n, 1]] = SRC[map[n, 0]] for k (program_id(1) == 0) or v, chunk program_id(0) % chunks of
    pair program_id(0) // chunks."""
    i = tl.program_id(0)
    n = (i // chunks).to(tl.int64)
    c = (i % chunks).to(tl.int64)
    s = tl.load(MAP + 2 * n).to(tl.int64)
    d = tl.load(MAP + 2 * n + 1).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    if tl.program_id(1) == 0:
        x = tl.load(SRC_K + s * block_numel + offs, mask=mask)
        tl.store(DST_K + d * block_numel + offs, x, mask=mask)
    else:
        x = tl.load(SRC_V + s * block_numel + offs, mask=mask)
        tl.store(DST_V + d * block_numel + offs, x, mask=mask)


# A swap calls this once per layer with the same mapping: its device copy is made once (the last mapping
# seen, held by a weak reference so a new tensor at a reused address is never mistaken for it), and the
# pinned check of a host cache once per address. The per-layer host work is what the thread that also
# launches the forward pays (docs/benchmarks.md).
_last_map: tuple = (None, None, None)
_pinned: dict[int, bool] = {}


def _device_mapping(m: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``m`` on ``device``, copied on the current stream (a copy made on another stream is not reused)."""
    global _last_map
    ref, key, got = _last_map
    here = (device, torch.cuda.current_stream(device) if device.type == "cuda" else None)
    if ref is not None and ref() is m and key == here:
        return got
    got = m.to(device, torch.long, non_blocking=True).contiguous()
    _last_map = (weakref.ref(m), here, got)
    return got


def _reachable(t: torch.Tensor, device: torch.device) -> bool:
    """Whether the kernel on ``device`` can address ``t`` in place (on the device, or pinned host memory)."""
    if t.device == device:
        return True
    if t.device.type != "cpu" or device.type != "cuda":
        return False
    ptr = t.data_ptr()
    ok = _pinned.get(ptr)
    if ok is None:
        ok = _pinned[ptr] = t.is_pinned()
        if len(_pinned) > 4096:
            _pinned.clear()
    return ok


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_KV else t  # fp8 as bytes: no fp8 support needed to copy


def swap_layer(src, dst, block_mapping) -> None:
    if block_mapping.numel() == 0:
        return
    dev = next((t.device for t in (*src, *dst) if t.device.type != "cpu"), None)
    if dev is None and _triton_runs_on(torch.device("cpu")):
        dev = torch.device("cpu")  # the interpreter: host memory on both sides
    ok = dev is not None and len(src) == len(dst) and all(
        _reachable(t, dev) and t.is_contiguous() for t in (*src, *dst)) and all(
        s.dtype == d.dtype and s[0].numel() == d[0].numel() for s, d in zip(src, dst))
    if not ok:
        for s, d in zip(src, dst):
            swap_blocks(s, d, block_mapping)
        return
    m = _device_mapping(block_mapping, dev)
    n = m.shape[0]
    for i in range(0, len(src), 2):  # (k, v) pairs: one launch; a lone last tensor is copied alone
        j = min(i + 1, len(src) - 1)
        numel = src[i][0].numel()
        block = min(CHUNK, triton.next_power_of_2(numel))
        chunks = triton.cdiv(numel, block)
        _swap_layer_kernel[(n * chunks, 2 if j > i else 1)](_flat(src[i]), _flat(src[j]), _flat(dst[i]),
                                                            _flat(dst[j]), m, numel, chunks, BLOCK=block,
                                                            num_warps=4)


def swap_layer_async(src, dst, block_mapping, stream=None):
    dev = next(t.device for t in list(src) + list(dst) if t.device.type != "cpu")
    mod = getattr(torch, dev.type)  # the device module; the op's requires() checked it has streams
    stream = stream or mod.current_stream(dev)
    with mod.stream(stream):
        swap_layer(src, dst, block_mapping)
        event = mod.Event()
        event.record(stream)
    return event
