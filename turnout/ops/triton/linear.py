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
with PDL (docs/benchmarks.md, "tiles tuned inside the decode step"): a kernel that is best alone is not always best
in the chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import triton
import triton.language as tl

from turnout.ops.reference.linear import MAX_M
from turnout.ops.triton._pdl import pdl_args, pdl_wait
from turnout.ops.triton._tuning import interpreted

_INTERPRET = interpreted()
TILES_ENV = "TURNOUT_SMALL_M_TILES"  # one-row tile overrides by "N,K" (turnout/ops/triton/_tuning.py)


@dataclass(frozen=True)
class SmallMConfig:
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _x_tile(x_rows, r_rows, nw_ptr, ks, ok, k_ok, rstd, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """The input tile [BM, BK] at ks as the projection sees it. With NORM: rms_norm(x + residual) with the
    row statistics ``rstd``, rounded as the unfused add and norm would store them."""
    a = tl.load(x_rows + ks[None, :], mask=ok, other=0.0)
    if NORM:
        if HAS_RES:
            a = (a.to(tl.float32) + tl.load(r_rows + ks[None, :], mask=ok, other=0.0).to(tl.float32)).to(a.dtype)
        nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        a = ((a.to(tl.float32) * rstd[:, None]).to(a.dtype).to(tl.float32) * nw[None, :]).to(a.dtype)
    return a


@triton.jit
def _tiles(w_rows, x_rows, r_rows, nw_ptr, k0, ks, K, row_ok, rstd, EVEN_K: tl.constexpr, NORM: tl.constexpr,
           HAS_RES: tl.constexpr):
    """The weight tile [BN, BK] (contiguous along K) and the input tile [BM, BK] at k0."""
    k_ok = (k0 + ks) < K
    if EVEN_K:
        w = tl.load(w_rows + (k0 + ks)[None, :])
    else:
        w = tl.load(w_rows + (k0 + ks)[None, :], mask=k_ok[None, :], other=0.0)
    a = _x_tile(x_rows, r_rows, nw_ptr, k0 + ks, row_ok[:, None] & k_ok[None, :], k_ok, rstd, NORM, HAS_RES)
    return w, a


@triton.jit
def _row_prologue(x_rows, r_rows, ro_rows, no_rows, nw_ptr, row_ok, K, eps, BLOCK_M: tl.constexpr,
                  BLOCK_S: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """After the PDL wait: the rows' 1 / rms with NORM (program 0 also stores x + residual and the normed
    rows), else ones."""
    rstd = tl.full((BLOCK_M,), 1.0, tl.float32)
    if NORM:
        rstd = _row_rstd(x_rows, r_rows, row_ok, K, eps, BLOCK_M, BLOCK_S, HAS_RES)
        if tl.program_id(0) == 0:
            _store_rows(x_rows, r_rows, ro_rows, no_rows, nw_ptr, row_ok, K, rstd, BLOCK_S, HAS_RES)
    return rstd


@triton.jit
def _store_rows(x_rows, r_rows, ro_rows, no_rows, nw_ptr, row_ok, K, rstd, BLOCK_S: tl.constexpr,
                HAS_RES: tl.constexpr):
    """x + residual and the normed rows, for the rest of the layer (one program; outside the weight loop, whose
    pipelining a store under a branch would break)."""
    for k0 in range(0, K, BLOCK_S):
        ks = k0 + tl.arange(0, BLOCK_S)
        k_ok = ks < K
        ok = row_ok[:, None] & k_ok[None, :]
        if HAS_RES:
            a = tl.load(x_rows + ks[None, :], mask=ok, other=0.0)
            a = (a.to(tl.float32) + tl.load(r_rows + ks[None, :], mask=ok, other=0.0).to(tl.float32)).to(a.dtype)
            tl.store(ro_rows + ks[None, :], a, mask=ok)
        tl.store(no_rows + ks[None, :], _x_tile(x_rows, r_rows, nw_ptr, ks, ok, k_ok, rstd, True, HAS_RES), mask=ok)


@triton.jit
def _row_rstd(x_rows, r_rows, row_ok, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              HAS_RES: tl.constexpr):
    """1 / rms of each row of x + residual (rounded to x's dtype first), [BM] fp32; read from L2 once per
    program, in as few wide loads as fit in registers (``BLOCK_K`` here is the statistics tile; a loop of
    projection-wide tiles before the first product slowed Qwen3-8B's step, docs/benchmarks.md)."""
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (ks < K)[None, :]
        a = tl.load(x_rows + ks[None, :], mask=ok, other=0.0)
        if HAS_RES:
            a = (a.to(tl.float32) + tl.load(r_rows + ks[None, :], mask=ok, other=0.0).to(tl.float32)).to(a.dtype)
        af = a.to(tl.float32)
        ss += tl.sum(af * af, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _small_m_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, ro_ptr, no_ptr, M, N, K, eps,
                    stride_xm, stride_wn, stride_ym, stride_rm, stride_rom, stride_nom,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                    BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols = tl.where(col_ok, cols, 0)  # in-bounds addresses: the weight loads need no column mask
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    r_rows = r_ptr + rows.to(tl.int64)[:, None] * stride_rm
    ro_rows = ro_ptr + rows.to(tl.int64)[:, None] * stride_rom
    no_rows = no_ptr + rows.to(tl.int64)[:, None] * stride_nom
    ks = tl.arange(0, BLOCK_K)
    if USE_DOT:
        pdl_wait(PDL)
        rstd = _row_prologue(x_rows, r_rows, ro_rows, no_rows, nw_ptr, row_ok, K, eps, BLOCK_M, BLOCK_S, NORM,
                             HAS_RES)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w, a = _tiles(w_rows, x_rows, r_rows, nw_ptr, k0, ks, K, row_ok, rstd, EVEN_K, NORM, HAS_RES)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    else:  # one row: products summed along K in registers, reduced across lanes once at the end
        # the first weight tile is a constant: read before the wait (PDL)
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :])
        else:
            w = tl.load(w_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0)
        pdl_wait(PDL)
        rstd = _row_prologue(x_rows, r_rows, ro_rows, no_rows, nw_ptr, row_ok, K, eps, BLOCK_M, BLOCK_S, NORM,
                             HAS_RES)
        a = _x_tile(x_rows, r_rows, nw_ptr, ks, row_ok[:, None] & (ks < K)[None, :], ks < K, rstd, NORM, HAS_RES)
        part = w.to(tl.float32) * a.to(tl.float32)  # [BN, BK] * [1, BK]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w, a = _tiles(w_rows, x_rows, r_rows, nw_ptr, k0, ks, K, row_ok, rstd, EVEN_K, NORM, HAS_RES)
            part += w.to(tl.float32) * a.to(tl.float32)
        acc = tl.sum(part, axis=1)[None, :]  # [1, BN]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + out_cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def block_m_for(m: int) -> int:
    """Rows per program: one on the CUDA cores, else 16 on the tensor cores."""
    return 1 if m == 1 else 16


def pick_config(m: int, n: int, k: int, tiles: Mapping | None = None) -> SmallMConfig:
    """Tiles from the H200 sweeps (docs/benchmarks.md): per kernel for 2-16 rows, in a decode step for one row
    (where ``tiles``, ``TURNOUT_SMALL_M_TILES`` bound by the op table, may override them by N and K)."""
    if block_m_for(m) == 16:
        return SmallMConfig(block_n=32, block_k=128, num_warps=4, num_stages=4)
    override = tiles.get((n, k)) if tiles else None  # validated by turnout.envs
    if override is not None:
        return SmallMConfig(*override)
    if n <= 1024:  # MoE routers (N = experts), small models: few rows per program, so at least ~64 programs
        return SmallMConfig(block_n=_pow2_floor(max(1, min(8, n // 64))), block_k=2048, num_warps=4, num_stages=2)
    if n >= 16384:  # LM heads, wide MLPs: programs enough at 32 rows each
        return SmallMConfig(block_n=32, block_k=128, num_warps=8, num_stages=5)
    if n <= 2048:
        return SmallMConfig(block_n=4, block_k=2048, num_warps=4, num_stages=3)
    # 2048 < N < 16384 (attention and MLP projections): 4 rows per program, long K tiles
    return SmallMConfig(block_n=4, block_k=1024, num_warps=4, num_stages=4)


def _check_2d(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"{name} takes x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"{name} takes at most {MAX_M} rows, got x with {x.shape[0]}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x, weight, bias, y, config, residual=None, norm_weight=None, eps=0.0, r_out=None, n_out=None,
            tiles=None):
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or pick_config(m, n, k, tiles)
    bm = block_m_for(m)
    use_dot = bm == 16
    bk = max(16, min(cfg.block_k, _pow2(k)))
    bn = max(16 if use_dot else 1, min(cfg.block_n, _pow2(n)))
    precision = "ieee" if x.dtype == torch.float32 else None  # fp32 must not become tf32
    upcast = _INTERPRET and x.dtype == torch.bfloat16  # the interpreter's bf16 dot is unreliable
    norm = norm_weight is not None
    r = residual if residual is not None else x
    ro = r_out if r_out is not None else x
    no = n_out if n_out is not None else x
    _small_m_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else y, y, r, norm_weight if norm else x, ro, no, m, n, k, eps,
        x.stride(0), weight.stride(0), y.stride(0), r.stride(0), ro.stride(0), no.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        USE_DOT=use_dot, PRECISION=precision, UPCAST=upcast, NORM=norm, HAS_RES=residual is not None,
        BLOCK_S=max(16, min(_pow2(k), 8192 // bm)),
        num_warps=cfg.num_warps, num_stages=1 if _INTERPRET else cfg.num_stages, **pdl_args(x, "linear"))


def norm_fusion_pays(n: int, k: int) -> bool:
    """Whether ``add_rms_norm_linear`` beats a norm kernel plus ``small_m_linear`` for one row of this shape.

    Measured in captured decode steps on the H200 (docs/benchmarks.md, "norms fused into projections"): with the norm
    fused, Qwen3-30B-A3B (qkv 5120 x 2048 in 2 K tiles, router 128 x 2048 in one) took 2.600 ms against 2.656,
    but Qwen3-8B (qkv 6144 x 4096 in 4 K tiles, gate_up 24576 x 4096 in 32) 4.670 against 4.268. So only
    projections that stream K in at most two tiles, below the LM-head widths, take the fused kernel. The
    measured built-in tiles decide, not a tuning override: the plan is made once, from the measurements.
    """
    return n < 16384 and k <= 2 * pick_config(1, n, k).block_k


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   config: SmallMConfig | None = None, *, tiles: Mapping | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16), weight [N, K], bias [N] or None -> [M, N] in x's dtype. ``tiles``: one-row tile
    overrides by (N, K), bound once by the op table (turnout/ops/triton/_tuning.py)."""
    _check_2d("small_m_linear", x, weight)
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    _launch(_unit_last(x), _unit_last(weight), bias, y, config, tiles=tiles)
    return y


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None,
                        config: SmallMConfig | None = None, *, tiles: Mapping | None = None):
    """See turnout/ops/reference/linear.py: -> (y [M, N], x + residual [M, K], normed [M, K]).

    Every program computes the row statistics itself (x and residual are a few KB, read from L2), so the norm
    adds no kernel and no dependent memory round trip; program 0 also stores x + residual and the normed rows.
    """
    _check_2d("add_rms_norm_linear", x, weight)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rms_norm_linear: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    if norm_weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm_linear: norm_weight {tuple(norm_weight.shape)} must be [{x.shape[1]}]")
    m, n = x.shape[0], weight.shape[0]
    x = _unit_last(x)
    residual = _unit_last(residual) if residual is not None else None
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else x
    normed = torch.empty_like(x)
    if m == 0:
        return y, r_out, normed
    if n == 0:  # no program would write the side outputs
        from turnout.ops.reference.linear import add_rms_norm_linear as reference

        _, r, nm = reference(x, residual, norm_weight, eps, weight, bias)
        return y, r, nm
    _launch(x, _unit_last(weight), bias, y, config, residual, norm_weight, float(eps),
            r_out if residual is not None else None, normed, tiles)
    return y, r_out, normed
