"""small_m_linear: y = x W^T (+ b) for inputs of a few rows (decode), streaming W once at full bandwidth.

At decode a projection's input has 1-16 rows, so the GEMM is a pure weight stream: each weight element is
used M times, and the time is the time to read W. Vendor BLAS libraries pick tile shapes for compute and
reach well under the copy bandwidth on these shapes (cuBLAS on the H200: ~40 % of copy bandwidth for the
2-20 MB projections of Qwen3-30B-A3B at batch 1, docs/benchmarks.md). Here:

* a program owns ``BLOCK_N`` output columns (rows of W, contiguous along K) and loops over all of K, so
  every byte of W is read exactly once, with 16-byte loads pipelined ``num_stages`` deep; no split-K,
  so no workspace and no second kernel;
* the rows of x (at most 16, a few KB) are re-read from L1/L2 by every program;
* one row (M == 1) multiplies on the CUDA cores into a [BLOCK_N, BLOCK_K] fp32 partial that is reduced
  across lanes once, after the loop (a reduction per iteration costs more than the loads); two or more
  rows use ``tl.dot`` with BLOCK_M = 16 (rows beyond M are masked to zero).

With programmatic dependent launch (turnout/ops/triton/_pdl.py) the one-row path reads its first weight
tile before waiting for the previous kernel. Accumulation is fp32; the output has x's dtype. The config is
chosen from (M, N, K) by ``pick_config``: first tuned per kernel on the H200 (``benchmarks/small_m_linear.py
--sweep``), then the one-row tiles re-tuned in place, in a captured decode step of Qwen3-30B-A3B and Qwen3-8B
with PDL (docs/benchmarks.md, fourth session): a kernel that is best alone is not always best in the chain.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from turnout.ops.reference.linear import MAX_M
from turnout.ops.triton._pdl import pdl_args, pdl_wait
from turnout.ops.triton._tuning import env_object

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TILES_ENV = "TURNOUT_SMALL_M_TILES"  # one-row tile overrides by "N,K" (turnout/ops/triton/_tuning.py)


@dataclass(frozen=True)
class SmallMConfig:
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _tile(w_rows, x_rows, k0, K, row_ok, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The weight tile [BN, BK] (contiguous along K) and the x tile [BM, BK] at k0."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        w = tl.load(w_rows + ks[None, :])
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
    else:
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return w, a


@triton.jit
def _small_m_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                    stride_xm, stride_wn, stride_ym,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols = tl.where(col_ok, cols, 0)  # in-bounds addresses: the weight loads need no column mask
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    if USE_DOT:
        pdl_wait(PDL)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w, a = _tile(w_rows, x_rows, k0, K, row_ok, BLOCK_K, EVEN_K)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    else:  # one row: products summed along K in registers, reduced across lanes once at the end
        ks = tl.arange(0, BLOCK_K)  # the first weight tile is a constant: read before the wait (PDL)
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :])
        else:
            w = tl.load(w_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0)
        pdl_wait(PDL)
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        part = w.to(tl.float32) * a.to(tl.float32)  # [BN, BK] * [1, BK]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w, a = _tile(w_rows, x_rows, k0, K, row_ok, BLOCK_K, EVEN_K)
            part += w.to(tl.float32) * a.to(tl.float32)
        acc = tl.sum(part, axis=1)[None, :]  # [1, BN]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + out_cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_m_for(m: int) -> int:
    """Rows per program: one on the CUDA cores, else 16 on the tensor cores."""
    return 1 if m == 1 else 16


def pick_config(m: int, n: int, k: int) -> SmallMConfig:
    """Tiles from the H200 sweeps (docs/benchmarks.md): per kernel for 2-16 rows, in a decode step for one row
    (where ``TURNOUT_SMALL_M_TILES`` may override them by N and K)."""
    if block_m_for(m) == 16:
        return SmallMConfig(block_n=32, block_k=128, num_warps=4, num_stages=4)
    override = env_object(TILES_ENV).get(f"{n},{k}")
    if override is not None:
        if (not isinstance(override, list) or len(override) != 4
                or not all(isinstance(v, int) and v > 0 for v in override)):
            raise ValueError(f"{TILES_ENV}[{n},{k}] must be [block_n, block_k, num_warps, num_stages] of positive "
                             f"ints, got {override!r}")
        return SmallMConfig(*override)
    if n <= 1024:  # MoE routers (N = experts), small models: few rows per program, so at least ~64 programs
        return SmallMConfig(block_n=max(1, min(8, n // 64)), block_k=2048, num_warps=4, num_stages=2)
    if n >= 16384:  # LM heads, wide MLPs: programs enough at 32 rows each
        return SmallMConfig(block_n=32, block_k=128, num_warps=8, num_stages=5)
    if n <= 2048:
        return SmallMConfig(block_n=4, block_k=2048, num_warps=4, num_stages=3)
    # 2048 < N < 16384 (attention and MLP projections): 4 rows per program, long K tiles
    return SmallMConfig(block_n=4, block_k=1024, num_warps=4, num_stages=4)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   config: SmallMConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16), weight [N, K], bias [N] or None -> [M, N] in x's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"small_m_linear takes x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_M:
        raise ValueError(f"small_m_linear takes at most {MAX_M} rows, got x with {m}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or pick_config(m, n, k)
    bm = block_m_for(m)
    use_dot = bm == 16
    bk = max(16, min(cfg.block_k, _pow2(k)))
    bn = max(16 if use_dot else 1, min(cfg.block_n, _pow2(n)))
    precision = "ieee" if x.dtype == torch.float32 else None  # fp32 must not become tf32
    upcast = _INTERPRET and x.dtype == torch.bfloat16  # the interpreter's bf16 dot is unreliable
    _small_m_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else y, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        USE_DOT=use_dot, PRECISION=precision, UPCAST=upcast,
        num_warps=cfg.num_warps, num_stages=1 if _INTERPRET else cfg.num_stages, **pdl_args(x))
    return y
