"""Rotary position embedding, in place on q and k (neox or gptj pairs, partial rotary, strided views)."""

import torch
import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_args, pdl_wait
from turnout.ops.triton.cache import ROUND_FP8, fp8_kv_args, quantize_kv


@triton.jit
def _pair_index(offs_i, IS_NEOX: tl.constexpr, HALF: tl.constexpr):
    """The two elements rotated together: halves (neox) or interleaved pairs (gptj)."""
    if IS_NEOX:
        i1 = offs_i
        i2 = offs_i + HALF
    else:
        i1 = offs_i * 2
        i2 = offs_i * 2 + 1
    return i1, i2


@triton.jit
def _rotate_heads(base, stride_h, h0, num_heads, cos, sin, offs_i,
                  IS_NEOX: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & (offs_i < HALF)[None, :]
    i1, i2 = _pair_index(offs_i, IS_NEOX, HALF)
    p1 = base + offs_h[:, None] * stride_h + i1[None, :]
    p2 = base + offs_h[:, None] * stride_h + i2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(p1, (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(p2, (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(POS, Q, K, CS, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, num_q_heads,
                   num_k_heads, IS_NEOX: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    pos = tl.load(POS + t).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    cmask = offs_i < HALF
    cos = tl.load(CS + pos * stride_cs + offs_i, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(CS + pos * stride_cs + HALF + offs_i, mask=cmask, other=0.0).to(tl.float32)
    if h0 < num_q_heads:
        _rotate_heads(Q + t * stride_qt, stride_qh, h0, num_q_heads, cos, sin, offs_i, IS_NEOX, HALF, BLOCK_H,
                      BLOCK_HALF)
    if h0 < num_k_heads:
        _rotate_heads(K + t * stride_kt, stride_kh, h0, num_k_heads, cos, sin, offs_i, IS_NEOX, HALF, BLOCK_H,
                      BLOCK_HALF)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    rot_dim = cos_sin_cache.shape[-1]
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary_embedding needs a unit stride on the head dimension")
    hq, hk = query.shape[1], key.shape[1]
    block_h = min(triton.next_power_of_2(max(hq, hk)), 16)
    grid = (num_tokens, triton.cdiv(max(hq, hk), block_h))
    _rotary_kernel[grid](positions, query, key, cos_sin_cache, query.stride(0), query.stride(1), key.stride(0),
                         key.stride(1), cos_sin_cache.stride(0), hq, hk, IS_NEOX=bool(is_neox), HALF=rot_dim // 2,
                         BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(rot_dim // 2), num_warps=4,
                         **pdl_args(query))


@triton.jit
def _norm_rotate_heads(base, stride_h, h0, num_heads, W, eps, cos, sin, offs_i, offs_t, dst, dst_stride_h,
                       dst_heads, D: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, TO_DST: tl.constexpr, DS, FP8_KV: tl.constexpr,
                       ROUND: tl.constexpr):
    """RMSNorm over each of BLOCK_H heads (D values), then RoPE on the first ROT. The head is read once,
    as its two rotating halves (pairs) and the tail beyond ROT. Rounding as the reference does:
    normalised in float32, rounded to the input dtype, scaled by the weight, rounded, then rotated in
    float32. ``TO_DST``: the result is also stored at ``dst`` (a KV-cache slot), for heads below
    ``dst_heads`` (0: a padding token, nothing stored), quantised there for an fp8 cache (scale at ``DS``)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    h_ok = offs_h < num_heads
    i1, i2 = _pair_index(offs_i, IS_NEOX, HALF)
    i_ok = offs_i < HALF
    m = h_ok[:, None] & i_ok[None, :]
    tail = ROT + offs_t
    t_ok = tail < D
    mt = h_ok[:, None] & t_ok[None, :]
    row = base + offs_h[:, None] * stride_h
    x1 = tl.load(row + i1[None, :], mask=m, other=0.0)
    x2 = tl.load(row + i2[None, :], mask=m, other=0.0)
    xt = tl.load(row + tail[None, :], mask=mt, other=0.0)
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    xtf = xt.to(tl.float32)
    ss = tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1) + tl.sum(xtf * xtf, 1)
    r = (1.0 / tl.sqrt(ss / D + eps))[:, None]
    w1 = tl.load(W + i1, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + i2, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    wt = tl.load(W + tail, mask=t_ok, other=0.0).to(tl.float32)[None, :]
    y1 = (w1 * (x1f * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    y2 = (w2 * (x2f * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    yt = (wt * (xtf * r).to(dt).to(tl.float32)).to(dt)
    o1 = (y1 * cos[None, :] - y2 * sin[None, :]).to(dt)
    o2 = (y2 * cos[None, :] + y1 * sin[None, :]).to(dt)
    tl.store(row + i1[None, :], o1, mask=m)
    tl.store(row + i2[None, :], o2, mask=m)
    tl.store(row + tail[None, :], yt, mask=mt)
    if TO_DST:
        d_ok = (offs_h < dst_heads)[:, None]
        drow = dst + offs_h[:, None] * dst_stride_h
        tl.store(drow + i1[None, :], quantize_kv(o1, DS, FP8_KV, ROUND).to(dst.dtype.element_ty), mask=m & d_ok)
        tl.store(drow + i2[None, :], quantize_kv(o2, DS, FP8_KV, ROUND).to(dst.dtype.element_ty), mask=m & d_ok)
        tl.store(drow + tail[None, :], quantize_kv(yt, DS, FP8_KV, ROUND).to(dst.dtype.element_ty), mask=mt & d_ok)


@triton.jit
def _qk_norm_rotary_kernel(POS, Q, K, QW, KW, CS, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                           num_q_heads, num_k_heads,
                           V, KC, VC, SLOTS, stride_vt, stride_vh, stride_kcb, stride_kcs, stride_kch,
                           stride_vcb, stride_vcs, stride_vch, KS, VS,
                           D: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                           BS: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_CACHE: tl.constexpr, PDL: tl.constexpr,
                           FP8_KV: tl.constexpr = False, ROUND: tl.constexpr = False):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    pos = tl.load(POS + t).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    offs_t = tl.arange(0, BLOCK_TAIL)
    cmask = offs_i < HALF
    cos = tl.load(CS + pos * stride_cs + offs_i, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(CS + pos * stride_cs + HALF + offs_i, mask=cmask, other=0.0).to(tl.float32)
    if h0 < num_q_heads:
        _norm_rotate_heads(Q + t * stride_qt, stride_qh, h0, num_q_heads, QW, eps, cos, sin, offs_i, offs_t,
                           Q, 0, 0, D, ROT, IS_NEOX, HALF, BLOCK_H, False, Q, False, False)
    if h0 < num_k_heads:
        if WRITE_CACHE:
            slot = tl.load(SLOTS + t).to(tl.int64)
            cache_heads = tl.where(slot >= 0, num_k_heads, 0)  # slot -1: padding, nothing written
            slot = tl.maximum(slot, 0)
            blk, off = slot // BS, slot % BS
            kdst = KC + blk * stride_kcb + off * stride_kcs
            _norm_rotate_heads(K + t * stride_kt, stride_kh, h0, num_k_heads, KW, eps, cos, sin, offs_i, offs_t,
                               kdst, stride_kch, cache_heads, D, ROT, IS_NEOX, HALF, BLOCK_H, True, KS, FP8_KV, ROUND)
            offs_h = h0 + tl.arange(0, BLOCK_H)
            offs_d = tl.arange(0, BLOCK_D)
            vm = (offs_h < cache_heads)[:, None] & (offs_d < D)[None, :]
            v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=vm)
            vdst = VC + blk * stride_vcb + off * stride_vcs
            tl.store(vdst + offs_h[:, None] * stride_vch + offs_d[None, :],
                     quantize_kv(v, VS, FP8_KV, ROUND).to(VC.dtype.element_ty), mask=vm)
        else:
            _norm_rotate_heads(K + t * stride_kt, stride_kh, h0, num_k_heads, KW, eps, cos, sin, offs_i, offs_t,
                               K, 0, 0, D, ROT, IS_NEOX, HALF, BLOCK_H, False, K, False, False)


def _qk_norm_rotary(positions, query, key, q_weight, k_weight, eps, cos_sin_cache, is_neox, cache_args) -> None:
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    rot_dim = cos_sin_cache.shape[-1]
    d = query.shape[-1]
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("qk_norm_rotary needs a unit stride on the head dimension")
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    hq, hk = query.shape[1], key.shape[1]
    block_h = min(triton.next_power_of_2(max(hq, hk)), 8)
    grid = (num_tokens, triton.cdiv(max(hq, hk), block_h))
    if cache_args is None:
        value, k_cache, v_cache, slots = key, key, key, positions  # unused (WRITE_CACHE False)
        cache_strides, bs = (0,) * 8, 1
        ks, vs, fp8 = key, key, False
    else:
        value, k_cache, v_cache, slots, k_scale, v_scale = cache_args
        ks, vs, fp8 = fp8_kv_args(k_cache, k_scale, v_scale, key)
        if value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("qk_norm_rotary_cache needs a unit stride on the head dimension")
        cache_strides = (value.stride(0), value.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3])
        bs = k_cache.shape[1]
    _qk_norm_rotary_kernel[grid](
        positions, query, key, q_weight, k_weight, cos_sin_cache, float(eps), query.stride(0), query.stride(1),
        key.stride(0), key.stride(1), cos_sin_cache.stride(0), hq, hk,
        value, k_cache, v_cache, slots, *cache_strides, ks, vs,
        D=d, ROT=rot_dim, IS_NEOX=bool(is_neox), HALF=rot_dim // 2, BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(rot_dim // 2), BLOCK_TAIL=triton.next_power_of_2(max(d - rot_dim, 1)),
        BS=bs, BLOCK_D=triton.next_power_of_2(d), WRITE_CACHE=cache_args is not None, num_warps=4, FP8_KV=fp8,
        ROUND=fp8 and ROUND_FP8, **pdl_args(query))


def qk_norm_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """One launch for q/k RMSNorm + RoPE (the reference: turnout/ops/reference/rotary.py)."""
    _qk_norm_rotary(positions, query, key, q_weight, k_weight, eps, cos_sin_cache, is_neox, None)


def qk_norm_rotary_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor,
                         is_neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> None:
    """The same launch also writes the new k (normalised, rotated) and v into the paged cache (quantised for an
    fp8 one: turnout/ops/triton/cache.py)."""
    _qk_norm_rotary(positions, query, key, q_weight, k_weight, eps, cos_sin_cache, is_neox,
                    (value, k_cache, v_cache, slot_mapping, k_scale, v_scale))
