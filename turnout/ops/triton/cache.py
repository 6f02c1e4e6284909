"""Paged KV cache writes and whole-block copies (copy-on-write and GPU <-> CPU swapping).

An fp8 cache (turnout/ops/kv_cache.py): ``quantize_kv`` is the write every kernel that stores into the cache
uses (this one, qk_norm_rotary_cache, the rope-in-attention decode kernel): x / scale in float32 (div_rn, as
torch divides), clamped to +-448, then the cast. Under TRITON_INTERPRET=1 the interpreter's float32 -> fp8
cast rounds wrongly (31.3 -> 16, 100 -> 104, subnormals to 0), so there the value is first rounded to the
nearest e4m3 value in float32 arithmetic (``round_e4m3``, exact: it matched torch's cast on 4096 values across
every exponent), which the cast then keeps. Compiled kernels never take that branch. Block copies move fp8
caches as bytes.
"""

import torch
import triton
import triton.language as tl

from turnout.ops.kv_cache import FP8_KV
from turnout.ops.triton._pdl import pdl_args, pdl_wait
from turnout.ops.triton._tuning import interpreted

ROUND_FP8 = interpreted()  # the interpreter's fp8 cast needs values already on the e4m3 grid


@triton.jit
def round_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3fn value, ties to even, in float32: adding then
    subtracting c = ulp * 2^23 leaves x rounded at that ulp (the ulp of its binade, 2^(e-3), or the
    subnormal step 2^-9 below 2^-6)."""
    a = tl.abs(x)
    e = tl.floor(tl.log2(tl.maximum(a, 1e-30)))
    e = tl.where(tl.exp2(e) > a, e - 1.0, e)  # log2 may round across a power of two either way
    e = tl.where(tl.exp2(e + 1.0) <= a, e + 1.0, e)
    c = tl.exp2(tl.maximum(e, -6.0) - 3.0) * 8388608.0
    r = (a + c) - c
    return tl.where(x < 0, -r, r)


@triton.jit
def quantize_kv(x, S, FP8_KV: tl.constexpr, ROUND: tl.constexpr):
    """What the cache stores for x: x itself, or for an fp8 cache float32 x / scale (S: its [1] f32 scale)
    clamped to e4m3's range (the caller casts to the cache's element type)."""
    y = x
    if FP8_KV:
        y = tl.math.div_rn(x.to(tl.float32), tl.load(S))
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if ROUND:
            y = round_e4m3(y)
    return y


def fp8_kv_args(k_cache: torch.Tensor, k_scale, v_scale, like: torch.Tensor):
    """(k_scale, v_scale, FP8_KV) for a kernel launch: the cache's scales (None: 1.0), or placeholders."""
    if k_cache.dtype != FP8_KV:
        return like, like, False
    one = None
    if k_scale is None or v_scale is None:
        one = torch.ones(1, dtype=torch.float32, device=k_cache.device)
    ks = one if k_scale is None else k_scale.float().reshape(-1)[:1]
    vs = one if v_scale is None else v_scale.float().reshape(-1)[:1]
    return ks, vs, True


@triton.jit
def _reshape_and_cache_kernel(KEY, VALUE, KC, VC, SLOTS, KS, VS, stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                              num_heads, BS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_D: tl.constexpr, PDL: tl.constexpr, FP8_KV: tl.constexpr = False,
                              ROUND: tl.constexpr = False):
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
        tl.store(kdst, quantize_kv(k, KS, FP8_KV, ROUND).to(KC.dtype.element_ty), mask=mask)
        tl.store(vdst, quantize_kv(v, VS, FP8_KV, ROUND).to(VC.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    t, hk, d = key.shape
    if t == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("reshape_and_cache needs a unit stride on the head dimension")
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(hk), 4096 // block_d))
    grid = (t, triton.cdiv(hk, block_h))
    ks, vs, fp8 = fp8_kv_args(k_cache, k_scale, v_scale, key)
    _reshape_and_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, ks, vs, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), hk, BS=k_cache.shape[1], D=d, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
        FP8_KV=fp8, ROUND=fp8 and ROUND_FP8, **pdl_args(key))


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
    if src.dtype == FP8_KV:  # bytes: a copy needs no fp8 support of the target
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
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
    if src.dtype == FP8_KV:  # bytes (torch has no fp8 index_copy_ on CPU)
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
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
