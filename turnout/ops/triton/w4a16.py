"""w4a16_linear kernels (turnout/ops/reference/w4a16.py has the layout: 64-row blocks, each one contiguous run of
K x 32 bytes whose low nibbles are the block's first 32 rows and high nibbles its last 32).

* One row (decode): the weight stream. A program owns one 64-row block and a slice of K, reads its bytes once
  (the contiguous [BLOCK_K, 32] tiles of the block), sums q x over each group on the CUDA cores and applies the
  group's scale and zero once per group: ``sum((q - 8) s + z) x = s (sum q x - 8 sum x) + z sum x``. Blocks are
  N / 64 programs (64 for a 4096-row projection), too few to keep a GPU's memory busy, so K is split over
  programs until there are about four per SM, and the float32 partial sums are added after.
* More rows (prefill): a tiled GEMM, one 64-row block per program column; each [BLOCK_K, 32] byte tile is
  dequantised in registers to x's dtype (two [BLOCK_K, 32] halves) and multiplied on the matrix units.

Activation order reads x through ``act_perm`` (a gather of the row's columns), so the weight is never permuted
at run time. Under TRITON_INTERPRET=1 bfloat16 tiles are upcast (the interpreter's bfloat16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.triton._tuning import interpreted
from turnout.ops.w4_layout import ROWS, check_layout

_INTERPRET = interpreted()


@triton.jit
def _row_kernel(x_ptr, perm_ptr, qw_ptr, sz_ptr, b_ptr, y_ptr, part_ptr, N, K, K_SPLIT,
                GROUP: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                BLOCK_K: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    GPB: tl.constexpr = BLOCK_K // GROUP
    j = tl.arange(0, 32)
    ks = tl.arange(0, BLOCK_K)
    gs = tl.arange(0, GPB)
    base = qw_ptr + blk * K * 32
    sz_cols = (blk * 64 + j) * 2
    acc_lo = tl.zeros((GPB, 32), dtype=tl.float32)
    acc_hi = tl.zeros((GPB, 32), dtype=tl.float32)
    k_begin = split * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + ks
        k_ok = k < k_end
        t = tl.load(base + k[:, None] * 32 + j[None, :], mask=k_ok[:, None], other=0).to(tl.int32)
        if HAS_PERM:
            col = tl.load(perm_ptr + k, mask=k_ok, other=0)
        else:
            col = k
        x = tl.load(x_ptr + col, mask=k_ok, other=0.0).to(tl.float32)
        x3 = tl.reshape(x, (GPB, GROUP, 1))
        lo = tl.reshape((t & 15).to(tl.float32), (GPB, GROUP, 32))
        hi = tl.reshape((t >> 4).to(tl.float32), (GPB, GROUP, 32))
        qx_lo = tl.sum(lo * x3, axis=1)  # [GPB, 32]: sum over each group of q x
        qx_hi = tl.sum(hi * x3, axis=1)
        xs = tl.sum(x3, axis=1)  # [GPB, 1]
        g = k0 // GROUP + gs
        g_ok = (g * GROUP) < k_end
        sz_row = sz_ptr + g.to(tl.int64)[:, None] * N * 2 + sz_cols[None, :]
        s_lo = tl.load(sz_row, mask=g_ok[:, None], other=0.0).to(tl.float32)
        z_lo = tl.load(sz_row + 1, mask=g_ok[:, None], other=0.0).to(tl.float32)
        s_hi = tl.load(sz_row + 64, mask=g_ok[:, None], other=0.0).to(tl.float32)
        z_hi = tl.load(sz_row + 65, mask=g_ok[:, None], other=0.0).to(tl.float32)
        acc_lo += s_lo * (qx_lo - 8.0 * xs) + z_lo * xs
        acc_hi += s_hi * (qx_hi - 8.0 * xs) + z_hi * xs
    out_lo = tl.sum(acc_lo, axis=0)
    out_hi = tl.sum(acc_hi, axis=0)
    rows = blk * 64 + j
    if PARTIAL:
        tl.store(part_ptr + split * N + rows, out_lo)
        tl.store(part_ptr + split * N + rows + 32, out_hi)
    else:
        if HAS_BIAS:
            out_lo += tl.load(b_ptr + rows).to(tl.float32)
            out_hi += tl.load(b_ptr + rows + 32).to(tl.float32)
        tl.store(y_ptr + rows, out_lo.to(y_ptr.dtype.element_ty))
        tl.store(y_ptr + rows + 32, out_hi.to(y_ptr.dtype.element_ty))


@triton.jit
def _gemm_kernel(x_ptr, perm_ptr, qw_ptr, sz_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                 GROUP: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    blk = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows_c = tl.where(row_ok, rows, 0).to(tl.int64)
    j = tl.arange(0, 32)
    ks = tl.arange(0, BLOCK_K)
    base = qw_ptr + blk * K * 32
    sz_cols = (blk * 64 + j) * 2
    acc_lo = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        if HAS_PERM:
            col = tl.load(perm_ptr + k, mask=k_ok, other=0)
        else:
            col = k
        a = tl.load(x_ptr + rows_c[:, None] * stride_xm + col[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        t = tl.load(base + k[:, None] * 32 + j[None, :], mask=k_ok[:, None], other=0).to(tl.int32)
        if GROUP >= BLOCK_K:  # the tile lies in one group: one scale and zero per column
            sz_row = sz_ptr + (k0 // GROUP) * N * 2 + sz_cols[None, :]
            s_lo = tl.load(sz_row).to(tl.float32)
            z_lo = tl.load(sz_row + 1).to(tl.float32)
            s_hi = tl.load(sz_row + 64).to(tl.float32)
            z_hi = tl.load(sz_row + 65).to(tl.float32)
        else:
            sz_row = sz_ptr + (k // GROUP).to(tl.int64)[:, None] * N * 2 + sz_cols[None, :]
            s_lo = tl.load(sz_row, mask=k_ok[:, None], other=0.0).to(tl.float32)
            z_lo = tl.load(sz_row + 1, mask=k_ok[:, None], other=0.0).to(tl.float32)
            s_hi = tl.load(sz_row + 64, mask=k_ok[:, None], other=0.0).to(tl.float32)
            z_hi = tl.load(sz_row + 65, mask=k_ok[:, None], other=0.0).to(tl.float32)
        w_lo = ((t & 15).to(tl.float32) - 8.0) * s_lo + z_lo
        w_hi = ((t >> 4).to(tl.float32) - 8.0) * s_hi + z_hi
        if UPCAST:
            a32 = a.to(tl.float32)
            acc_lo += tl.dot(a32, w_lo, input_precision="ieee")
            acc_hi += tl.dot(a32, w_hi, input_precision="ieee")
        else:
            acc_lo += tl.dot(a, w_lo.to(a.dtype), input_precision=PRECISION)
            acc_hi += tl.dot(a, w_hi.to(a.dtype), input_precision=PRECISION)
    cols = blk * 64 + j
    if HAS_BIAS:
        acc_lo += tl.load(b_ptr + cols).to(tl.float32)[None, :]
        acc_hi += tl.load(b_ptr + cols + 32).to(tl.float32)[None, :]
    out = y_ptr + rows_c[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc_lo.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(out + 32, acc_hi.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


def _row(x, qweight, scale_zeros, group_size, act_perm, bias, n):
    k = x.shape[1]
    block_k = max(group_size, 256 if not _INTERPRET else group_size)
    blocks = n // ROWS
    # about four programs per SM of an H100/H200 (132 SMs); never below one K tile a program
    splits = max(1, min(triton.cdiv(k, block_k), 512 // blocks))
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_split)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    _row_kernel[(blocks, splits)](x, act_perm if act_perm is not None else x, qweight, scale_zeros,
                                  bias if bias is not None else y, y, part, n, k, k_split, GROUP=group_size,
                                  HAS_PERM=act_perm is not None, HAS_BIAS=bias is not None, PARTIAL=splits > 1,
                                  BLOCK_K=block_k, num_warps=4, num_stages=1 if _INTERPRET else 3)
    if splits > 1:
        out = part.sum(dim=0, keepdim=True)
        if bias is not None:
            out += bias.float()
        y.copy_(out)
    return y


def w4a16_linear(x, qweight, scale_zeros, group_size, act_perm=None, bias=None):
    """See turnout/ops/reference/w4a16.py: the streaming kernel at one row, the tiled GEMM beyond."""
    if x.dim() != 2:
        raise ValueError(f"w4a16_linear takes x [M, K], got {tuple(x.shape)}")
    n = check_layout(x.shape[1], qweight, scale_zeros, group_size, act_perm)
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    scale_zeros = scale_zeros.contiguous()
    if m == 1 and k:
        return _row(x, qweight, scale_zeros, group_size, act_perm, bias, n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    _gemm_kernel[(triton.cdiv(m, block_m), n // ROWS)](
        x, act_perm if act_perm is not None else x, qweight, scale_zeros, bias if bias is not None else y, y,
        m, n, k, x.stride(0), y.stride(0), GROUP=group_size, HAS_PERM=act_perm is not None,
        HAS_BIAS=bias is not None, UPCAST=_INTERPRET and x.dtype == torch.bfloat16,
        PRECISION="ieee" if x.dtype == torch.float32 else None, BLOCK_M=block_m, BLOCK_K=64,
        num_warps=4, num_stages=1 if _INTERPRET else 3)
    return y
