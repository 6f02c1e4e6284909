"""One layer's KV block swap as one kernel that reads and writes pinned host memory directly.

A GPU addresses pinned (page-locked) host memory through unified virtual addressing: the Triton launcher
turns a pinned CPU tensor's pointer into the device pointer that maps it (and refuses a pageable one), so
the kernel gathers blocks from wherever they are and stores them wherever they go, over PCIe, in one
launch per layer (k and v together) whatever the number of blocks or how scattered they are. The DMA path
(vendor.cuda: one ``cudaMemcpyAsync`` per run of consecutive blocks, per tensor) issues one call per
scattered block per layer per k/v from the host thread that also launches the forward: thousands for a
prefix-tier hit (docs/benchmarks.md, tenth session). A side-stream launch of this kernel overlaps the
forward like the DMA would, through the same per-layer events.

Each program copies one chunk of one block of k or v, as 32-bit words (fp8 and bf16 caches move as bytes).
Sides that are not pinned host memory or the GPU (a pageable CPU tensor, CPU-only runs) go through the
gather / copy / scatter path of ``cache.swap_blocks``; under TRITON_INTERPRET=1 both sides are CPU memory
and this kernel runs as written.
"""

import torch
import triton
import triton.language as tl

from turnout.ops.triton.cache import _triton_runs_on, swap_blocks

CHUNK = 2048  # 32-bit words per program: 8 KiB, 16 words (four 16-byte accesses) per thread at 4 warps


@triton.jit
def _swap_layer_kernel(SRC_K, SRC_V, DST_K, DST_V, MAP, block_words, chunks, BLOCK: tl.constexpr):
    """DST[map[n, 1]] = SRC[map[n, 0]] for k (program_id(1) == 0) or v, chunk program_id(0) % chunks of
    pair program_id(0) // chunks."""
    i = tl.program_id(0)
    n = (i // chunks).to(tl.int64)
    c = (i % chunks).to(tl.int64)
    s = tl.load(MAP + 2 * n).to(tl.int64)
    d = tl.load(MAP + 2 * n + 1).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_words
    if tl.program_id(1) == 0:
        x = tl.load(SRC_K + s * block_words + offs, mask=mask)
        tl.store(DST_K + d * block_words + offs, x, mask=mask)
    else:
        x = tl.load(SRC_V + s * block_words + offs, mask=mask)
        tl.store(DST_V + d * block_words + offs, x, mask=mask)


def _reachable(t: torch.Tensor, device: torch.device) -> bool:
    """Whether the kernel on ``device`` can address ``t`` in place."""
    if t.device == device:
        return True
    return t.device.type == "cpu" and device.type == "cuda" and t.is_pinned()


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [num_blocks, words] of 32 bits (bytes where a block is not a whole number of words)."""
    b = t.view(torch.uint8).reshape(t.shape[0], -1)
    return b.view(torch.int32) if b.shape[1] % 4 == 0 else b


def swap_layer(src, dst, block_mapping) -> None:
    if block_mapping.numel() == 0:
        return
    src, dst = list(src), list(dst)
    dev = next((t.device for t in src + dst if t.device.type != "cpu"), None)
    if dev is None and _triton_runs_on(torch.device("cpu")):
        dev = torch.device("cpu")  # the interpreter: host memory on both sides
    ok = dev is not None and len(src) == len(dst) and all(
        _reachable(t, dev) and t.is_contiguous() for t in src + dst) and all(
        s.dtype == d.dtype and s[0].numel() == d[0].numel() for s, d in zip(src, dst))
    if not ok:
        for s, d in zip(src, dst):
            swap_blocks(s, d, block_mapping)
        return
    m = block_mapping.to(dev, torch.long, non_blocking=True).contiguous()
    n = m.shape[0]
    for i in range(0, len(src), 2):  # (k, v) pairs: one launch; a lone last tensor copies itself twice
        j = min(i + 1, len(src) - 1)
        sk, sv, dk, dv = _words(src[i]), _words(src[j]), _words(dst[i]), _words(dst[j])
        words = sk.shape[1]
        block = min(CHUNK, triton.next_power_of_2(words))
        chunks = triton.cdiv(words, block)
        _swap_layer_kernel[(n * chunks, 2 if j > i else 1)](sk, sv, dk, dv, m, words, chunks, BLOCK=block,
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
