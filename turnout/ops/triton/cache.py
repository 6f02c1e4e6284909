"""Paged KV cache writes and whole-block copies (copy-on-write and GPU <-> CPU swapping)."""

import torch
import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_args, pdl_wait


@triton.jit
def _reshape_and_cache_kernel(KEY, VALUE, KC, VC, SLOTS, stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                              num_heads, BS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BS
        off = slot % BS
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < num_heads)[:, None] & (offs_d < D)[None, :]
        k = tl.load(KEY + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(VALUE + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        kdst = KC + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
        vdst = VC + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
        tl.store(kdst, k.to(KC.dtype.element_ty), mask=mask)
        tl.store(vdst, v.to(VC.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    t, hk, d = key.shape
    if t == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("reshape_and_cache needs a unit stride on the head dimension")
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(hk), 4096 // block_d))
    grid = (t, triton.cdiv(hk, block_h))
    _reshape_and_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), hk, BS=k_cache.shape[1], D=d, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4, **pdl_args(key))


@triton.jit
def _block_copy_kernel(SRC, DST, MAP, stride_map, block_numel, SRC_MAPPED: tl.constexpr, DST_MAPPED: tl.constexpr,
                       BLOCK: tl.constexpr):
    """DST[dst_block] = SRC[src_block] for row n of MAP [N, 2] (column 0: source, 1: destination).

    An unmapped side uses n itself: that is how blocks are gathered into, or scattered from, a packed
    staging buffer."""
    n = tl.program_id(0).to(tl.int64)
    if SRC_MAPPED:
        src_blk = tl.load(MAP + n * stride_map).to(tl.int64)
    else:
        src_blk = n
    if DST_MAPPED:
        dst_blk = tl.load(MAP + n * stride_map + 1).to(tl.int64)
    else:
        dst_blk = n
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    x = tl.load(SRC + src_blk * block_numel + offs, mask=mask)
    tl.store(DST + dst_blk * block_numel + offs, x, mask=mask)


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor, n: int, src_mapped: bool,
                 dst_mapped: bool) -> None:
    block_numel = src[0].numel()
    block = min(triton.next_power_of_2(block_numel), 4096)
    grid = (n, triton.cdiv(block_numel, block))
    _block_copy_kernel[grid](src, dst, mapping, mapping.stride(0), block_numel, SRC_MAPPED=src_mapped,
                             DST_MAPPED=dst_mapped, BLOCK=block, num_warps=4)


def _check_blocks(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("block copies need contiguous caches")


def _triton_runs_on(device: torch.device) -> bool:
    from turnout import envs

    return device.type != "cpu" or envs.get().triton_interpret


def copy_blocks(caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    n = block_mapping.shape[0]
    if n == 0:
        return
    mappings = {}  # one copy of the mapping per device, made without a host sync
    for cache in caches:
        _check_blocks(cache)
        m = mappings.get(cache.device)
        if m is None:
            m = mappings[cache.device] = block_mapping.to(cache.device).contiguous()
        _launch_copy(cache, cache, m, n, True, True)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    n = block_mapping.shape[0]
    if n == 0:
        return
    _check_blocks(src, dst)
    if src[0].numel() != dst[0].numel() or src.dtype != dst.dtype:
        raise ValueError("swap_blocks needs caches with the same block shape and dtype")
    if src.device == dst.device and _triton_runs_on(src.device):
        _launch_copy(src, dst, block_mapping.to(src.device).contiguous(), n, True, True)
        return
    # Across devices: gather the blocks into one packed buffer where they are, one copy across, scatter.
    if _triton_runs_on(src.device):
        staged = torch.empty((n, *src.shape[1:]), dtype=src.dtype, device=src.device)
        _launch_copy(src, staged, block_mapping.to(src.device).contiguous(), n, True, False)
    else:
        # Pinned when it is bound for a GPU, so that the copy across is a plain DMA.
        staged = torch.empty((n, *src.shape[1:]), dtype=src.dtype, device=src.device,
                             pin_memory=dst.device.type != "cpu" and torch.cuda.is_available())
        torch.index_select(src, 0, block_mapping[:, 0].to(src.device), out=staged)
    if dst.device.type == "cpu" and staged.device.type != "cpu":
        landed = torch.empty(staged.shape, dtype=staged.dtype, device="cpu",
                             pin_memory=torch.cuda.is_available())
        landed.copy_(staged)  # synchronous: dst must hold the blocks when this returns
    else:
        landed = staged.to(dst.device, non_blocking=True)
    if _triton_runs_on(dst.device) and landed.device == dst.device:
        _launch_copy(landed, dst, block_mapping.to(dst.device).contiguous(), n, False, True)
    else:
        dst.index_copy_(0, block_mapping[:, 1].to(dst.device), landed)
