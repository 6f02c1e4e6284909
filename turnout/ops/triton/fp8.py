"""FP8 kernels (turnout/ops/reference/fp8.py has the contracts and layouts).

* ``quantize_fp8``: one program per row; per-token scales take two passes over the row (max, then divide),
  per-128-group scales one (each group is one tile).
* ``scaled_mm`` / ``block_scaled_mm`` / ``fp8_linear`` at M > 1: one tiled GEMM kernel. K advances 128 at a
  time, so each K tile is one scale group: with fp8 x, ``tl.dot`` of two fp8 tiles (the fp8 matrix units on
  sm89+) accumulates in float32 and the tile's product is multiplied by the group scales of x (per row) and
  of W (per 128 rows), where the layout has them; per-token and per-channel scales multiply once, after the
  loop. Weight-only (x unquantised) the fp8 tile is converted to x's dtype and multiplied on the 16-bit units.
  On sm90 an fp8 ``tl.dot`` sums in the matrix units' reduced precision (about 14 bits; Triton's default
  there, as fast as fp8 gets), so adding each 128-wide tile's product into the float32 ``acc`` is the
  promotion interval: the error is ~2^-13 of sum |x w| (the conformance bound, ops/reference/fp8.py). A fused
  ``tl.dot(a, b, acc)`` would accumulate all of K imprecisely; Triton does not fuse fp8 dots on sm90.
* ``fp8_linear`` at one row: the decode kernel. Like ``small_m_linear`` (ops/triton/linear.py) a program owns a
  few rows of W and streams all of K once, products summed in registers and reduced once at the end, but the
  weight is read as fp8: half the bytes. Block scales are folded into the x tile (a program's rows lie in one
  128-row block, so along K the scale is one value per 128 columns: x * s costs a vector, not a gather per
  weight element); per-row scales multiply the sums.

Under TRITON_INTERPRET=1 two interpreter faults are worked around (both as the interpreter of Triton 3.x has
them; compiled kernels never take these branches): its float32 -> fp8 cast rounds values that should round up
across a power of two to the power below (31.3 -> 16), so the quantised values are stored in float32 and
cast by torch; and its bfloat16 ``tl.dot`` is wrong, so bf16 tiles are upcast (fp8 dots are exact there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.reference.fp8 import BLOCK, FP8, FP8_MAX, MIN_SCALE, weight_layout
from turnout.ops.triton._tuning import interpreted
from turnout.ops.triton.cache import round_e4m3

_INTERPRET = interpreted()


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_xm, stride_qm, stride_sm, G,
                  GROUPED: tl.constexpr, STATIC: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX_C: tl.constexpr,
                  MIN_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    ks = tl.arange(0, BLOCK_K)
    if GROUPED:  # BLOCK_K == 128: one group per tile
        for g in range(0, G):
            k = g * BLOCK_K + ks
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX_C), MIN_S)
            tl.store(s_ptr + row * stride_sm + g, s)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX_C), FP8_MAX_C)
            tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    else:
        if STATIC:
            s = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + ks
                amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
            s = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX_C), MIN_S)
        tl.store(s_ptr + row * stride_sm, s)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX_C), FP8_MAX_C)
            tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=k < K)


@triton.jit
def quantize_tile(x, MIN_S: tl.constexpr, ROUND_E4M3: tl.constexpr):
    """x [BM, 128] float32, one 128-group per row -> (x / s clamped to +-448, in float32; s [BM]) with s = max(max
    |x| / 448, MIN_S): quantize_fp8's arithmetic (the caller casts to fp8)."""
    s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0), MIN_S)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, s[:, None]), -448.0), 448.0)
    if ROUND_E4M3:
        q = round_e4m3(q)
    return q, s


def quantize_fp8(x: torch.Tensor, group_size: int = 0, input_scale: torch.Tensor | None = None):
    """See turnout/ops/reference/fp8.py."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8 takes x [M, K], got {tuple(x.shape)}")
    if group_size not in (0, BLOCK):
        raise ValueError(f"quantize_fp8: group_size must be 0 (per token) or {BLOCK}, got {group_size}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"quantize_fp8: input_scale must have one element, got {tuple(input_scale.shape)}")
    m, k = x.shape
    grouped = group_size == BLOCK and input_scale is None
    g = triton.cdiv(k, BLOCK) if grouped else 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(m, k, dtype=torch.float32 if _INTERPRET else FP8, device=x.device)
    s = torch.empty(m, g, dtype=torch.float32, device=x.device)
    if m and k:
        _quant_kernel[(m,)](x, q, s, input_scale if input_scale is not None else s, k, x.stride(0), q.stride(0),
                            s.stride(0), g, GROUPED=grouped, STATIC=input_scale is not None,
                            BLOCK_K=BLOCK if grouped else min(2048, triton.next_power_of_2(k)),
                            FP8_MAX_C=FP8_MAX, MIN_S=MIN_SCALE)
    elif m:
        s.fill_(float(input_scale.item()) if input_scale is not None else MIN_SCALE)
    return (q.to(FP8) if _INTERPRET else q), s


@triton.jit
def _gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_am, stride_asm, stride_wn, stride_wsn,
                 stride_ym, A_FP8: tl.constexpr, A_GROUPED: tl.constexpr, W_BLOCK: tl.constexpr,
                 HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # grouped program order: GROUP_M row tiles share each column tile while it is in L2
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rows_c, cols_c = tl.where(row_ok, rows, 0).to(tl.int64), tl.where(col_ok, cols, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows_c[:, None] * stride_am
    w_rows = w_ptr + cols_c[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_rows + (k0 + ks)[None, :], mask=k_ok[None, :], other=0.0)
        w = tl.load(w_rows + (k0 + ks)[None, :], mask=k_ok[None, :], other=0.0)
        if A_FP8:
            d = tl.dot(a, tl.trans(w))
        elif UPCAST:
            d = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=PRECISION)
        else:
            d = tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=PRECISION)
        kb = k0 // BLOCK_K
        if A_GROUPED:
            d = d * tl.load(as_ptr + rows_c * stride_asm + kb)[:, None]
        if W_BLOCK:
            d = d * tl.load(ws_ptr + (cols_c // BLOCK_K) * stride_wsn + kb)[None, :]
        acc += d
    if A_FP8 and not A_GROUPED:
        acc = acc * tl.load(as_ptr + rows_c * stride_asm)[:, None]
    if not W_BLOCK:
        acc = acc * tl.load(ws_ptr + cols_c * stride_wsn)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols_c).to(tl.float32)[None, :]
    tl.store(y_ptr + rows_c[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_K is the scale group, 128. Not yet swept on the H200."""
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 64, 128, 4, 3
    return 128, 128, 8, 3


def _gemm(a, a_scale, weight, weight_scale, bias, out_dtype, a_fp8: bool, a_grouped: bool, w_block: bool):
    m, k = a.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    a = a if a.stride(-1) == 1 else a.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    bm, bn, warps, stages = _tiles(m)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    scale_a = a_scale if a_scale is not None else weight_scale
    _gemm_kernel[grid](a, scale_a, weight, weight_scale, bias if bias is not None else y, y, m, n, k,
                       a.stride(0), scale_a.stride(0), weight.stride(0), weight_scale.stride(0), y.stride(0),
                       A_FP8=a_fp8, A_GROUPED=a_grouped, W_BLOCK=w_block, HAS_BIAS=bias is not None,
                       UPCAST=_INTERPRET and a.dtype == torch.bfloat16,
                       PRECISION="ieee" if a.dtype == torch.float32 else None,
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, GROUP_M=8, num_warps=warps,
                       num_stages=1 if _INTERPRET else stages)
    return y


def _check_act(xq, x_scale, weight, grouped_ok: bool) -> bool:
    m, k = xq.shape
    if weight.shape[1] != k:
        raise ValueError(f"fp8 GEMM: x {tuple(xq.shape)} and weight {tuple(weight.shape)} differ in K")
    g = triton.cdiv(k, BLOCK)
    if x_scale.shape == (m, 1) and not (grouped_ok and g == 1):
        return False
    if grouped_ok and x_scale.shape == (m, g):
        return g > 1
    raise ValueError(f"x_scale {tuple(x_scale.shape)} must be [{m}, 1]" + (f" or [{m}, {g}]" if grouped_ok else ""))


def scaled_mm(xq, x_scale, weight, weight_scale, bias=None, out_dtype=torch.bfloat16):
    """See turnout/ops/reference/fp8.py (per-row scales)."""
    _check_act(xq, x_scale, weight, False)
    if weight_layout(weight, weight_scale) != "row":
        raise ValueError(f"scaled_mm takes per-row weight scales [N, 1], got {tuple(weight_scale.shape)}")
    return _gemm(xq, x_scale, weight, weight_scale, bias, out_dtype, True, False, False)


def block_scaled_mm(xq, x_scale, weight, weight_scale, bias=None, out_dtype=torch.bfloat16):
    """See turnout/ops/reference/fp8.py (128 x 128 block weight scales)."""
    grouped = _check_act(xq, x_scale, weight, True)
    if weight_layout(weight, weight_scale) != "block":
        raise ValueError(f"block_scaled_mm takes 128x128 block weight scales, got {tuple(weight_scale.shape)}")
    return _gemm(xq, x_scale, weight, weight_scale, bias, out_dtype, True, grouped, True)


@triton.jit
def _row_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, N, K, stride_wn, stride_wsn, W_BLOCK: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols_c = tl.where(col_ok, cols, 0).to(tl.int64)
    w_rows = w_ptr + cols_c[:, None] * stride_wn
    block_row = ws_ptr + ((pid * BLOCK_N) // 128) * stride_wsn  # every row of this program is in this block
    ks = tl.arange(0, BLOCK_K)
    part = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])
            x = tl.load(x_ptr + k).to(tl.float32)
        else:
            w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        if W_BLOCK:
            x = x * tl.load(block_row + k // 128, mask=k < K, other=0.0)
        part += w.to(tl.float32) * x[None, :]
    acc = tl.sum(part, axis=1)
    if not W_BLOCK:
        acc = acc * tl.load(ws_ptr + cols_c * stride_wsn)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols_c).to(tl.float32)
    tl.store(y_ptr + cols, acc.to(y_ptr.dtype.element_ty), mask=col_ok)


def _row_tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the one-row kernel, the fastest of 30 tiles (2-16 KiB of fp8)
    on Qwen3-8B's projections on the H200, each from a CUDA graph of launches on weights not in L2
    (benchmarks/fp8_row_sweep.py; docs/benchmarks.md, "fp8 one-row and one-token kernels"): qkv 6144 x 4096 9.1 us, o
    4096 x 4096 7.2, gate_up 24576 x 4096 28.4, down 4096 x 12288 15.5 (the previous guesses: 10.4 / 7.9 / 30.7 / 15.9).
    BLOCK_N divides 128. Two variants lost there and are not kept: the row as a 16-row float16 tile on the
    matrix units (13.3 / 10.8 / 28.9 / 25.2 us), and float16 products and lane sums on the CUDA cores
    (10.1 / 7.9 / 28.7 / 17.4 us): fewer conversions a weight did not make it faster."""
    if n <= 1024:
        return max(1, min(8, n // 64)), 4096, 4, 2
    if k >= 8192:
        return 2, 2048, 4, 3
    if n <= 4096:
        return 8, 1024, 4, 3
    if n <= 8192:
        return 16, 512, 8, 3
    return 32, 512, 8, 3


def fp8_linear(x, weight, weight_scale, bias=None, *, tiles=None):
    """See turnout/ops/reference/fp8.py: the one-row decode kernel at M == 1, the tiled GEMM beyond. ``tiles``:
    one-row tile overrides by (N, K) (TURNOUT_SMALL_M_TILES), bound once by the op table."""
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_linear takes x [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}")
    w_block = weight_layout(weight, weight_scale) == "block"
    m, k = x.shape
    n = weight.shape[0]
    if m != 1 or k == 0 or n == 0:
        return _gemm(x, None, weight, weight_scale, bias, x.dtype, False, False, w_block)
    x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = (tiles.get((n, k)) if tiles else None) or _row_tiles(n, k)
    bk = max(128, min(bk, triton.next_power_of_2(k)))
    bn = 1 << (bn.bit_length() - 1)  # a power of two, so a program's rows never straddle a 128-row block
    _row_kernel[(triton.cdiv(n, bn),)](x, weight, weight_scale, bias if bias is not None else y, y, n, k,
                                       weight.stride(0), weight_scale.stride(0), W_BLOCK=w_block,
                                       HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
                                       num_warps=warps, num_stages=1 if _INTERPRET else stages)
    return y
