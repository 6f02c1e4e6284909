"""Batch-invariant Triton kernels: linear, attention, MoE experts (turnout/ops/batch_invariant.py).

What makes a row's bits independent of the batch here:

* linear: one GEMM kernel with ONE row tile (``BLOCK_M``) for every M, and no split-K: each output element is
  the sum over K in ``BLOCK_K`` steps, in order, of ``tl.dot`` products of the same tile shapes. The column
  and K tiles are chosen from (N, K) only, i.e. from the weight, never from M.
* attention: one kernel for prefill chunks, decode and cached prefixes. A program owns ``BLOCK_M`` query rows
  of one sequence and one query head and walks the keys in ``BLOCK_N`` blocks aligned to position 0, in
  order, with an online softmax; no split-KV. A block past a row's position is masked out entirely and leaves
  that row exactly as it was (scale exp2(0) = 1, add 0), so a row computes the same alone, in any chunk, at
  decode or over a prefix-cache hit.
* moe_experts: the grouped kernels of turnout/ops/triton/moe.py with one fixed tile config (their rows are
  (token, slot) pairs, each reduced on its own), then the slots summed in a fixed order (0, 1, ...).

Accumulation is float32; float32 inputs use IEEE dots (never TF32). CPU tests run these under
TRITON_INTERPRET=1 in float32 / float16 (the interpreter's bfloat16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.reference.attention_variants import check_variants
from turnout.ops.reference.batch_invariant import combine_slots
from turnout.ops.triton._tuning import interpreted
from turnout.ops.triton.moe import GemmConfig, grouped_pair_outputs

_INTERPRET = interpreted()
_LOG2E = tl.constexpr(1.4426950408889634)
GEMM_BLOCK_M = 32  # the one row tile of every linear call
ATTN_BLOCK_M, ATTN_BLOCK_N = 16, 32  # query rows per program; keys per step, aligned to position 0
# One config for every call (BLOCK_M 16 rows of (token, slot) pairs); the column / K tiles are clipped by
# the weight's own sizes only (moe._tile).
MOE_CONFIG = GemmConfig(16, 64, 64, 64, 64, num_warps=4, num_stages=3)


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else None


def _upcast(dtype) -> bool:
    return _INTERPRET and dtype == torch.bfloat16


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_wk, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _gemm_tiles(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) from the weight's shape only."""
    return (64 if n >= 8192 else 32), (64 if k >= 64 else max(16, triton.next_power_of_2(k)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``linear`` contract (turnout/ops/reference/matmul.py); y[i] depends on x[i] only."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    bn, bk = _gemm_tiles(n, k)
    _gemm_kernel[(triton.cdiv(m, GEMM_BLOCK_M), triton.cdiv(n, bn))](
        x2, weight, bias if bias is not None else y, y, m, n, k, x2.stride(0), weight.stride(0), weight.stride(1),
        y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=GEMM_BLOCK_M, BLOCK_N=bn, BLOCK_K=bk,
        PRECISION=_precision(x.dtype), UPCAST=_upcast(x.dtype), num_warps=4, num_stages=1 if _INTERPRET else 3)
    return y.view(*lead, n)


@triton.jit
def _tanh(x):
    """tanh from one exp2 (Triton has no portable tanh): 1 - 2 / (e^2x + 1), saturating to +-1."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return linear(x, weight, bias)


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, scale_log2, tiles_per_seq,
                 stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, block_size, group, D, sinks_ptr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr, WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
                 HAS_SINKS: tl.constexpr = False):
    """WINDOW / SOFTCAP / HAS_SINKS: the variants (turnout/ops/reference/attention_variants.py). With a window the
    walk starts at the aligned block holding the tile's first window position: a block before a row's own window
    is masked whole for it and leaves it exactly as it was (a row with no key yet stays at 0), so where the walk
    starts changes no row's bits; no key before the tile's first window position is loaded."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = pid // tiles_per_seq
    tile = pid % tiles_per_seq
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    kv_len = tl.load(seq_lens_ptr + seq)
    first = kv_len - q_len  # position of the first new token
    local = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local < q_len
    pos = first + local
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    kv_head = head // group
    q = tl.load(q_ptr + (q_start + local)[:, None].to(tl.int64) * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    end = first + tl.minimum(q_len, (tile + 1) * BLOCK_M)  # keys 0 .. end - 1 reach some row of the tile
    j0 = 0
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(first + tile * BLOCK_M - WINDOW + 1, 0)
        j0 = lo // BLOCK_N * BLOCK_N
    for j in range(j0, end, BLOCK_N):
        kpos = j + tl.arange(0, BLOCK_N)
        k_ok = kpos < kv_len
        if WINDOW > 0:
            k_ok = k_ok & (kpos >= lo)
        blk = tl.load(tables_ptr + seq * stride_tb + kpos // block_size, mask=k_ok, other=0).to(tl.int64)
        off = blk * stride_kb + (kpos % block_size) * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptr + off[:, None] + dims[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BN, BD]
        v = tl.load(v_ptr + off[:, None] + dims[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BM, BN], log2 units
        if SOFTCAP > 0.0:
            s = (SOFTCAP * _LOG2E) * _tanh(s / (SOFTCAP * _LOG2E))
        if WINDOW > 0:
            s = tl.where((kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - WINDOW), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        l_i = l_i * alpha + tl.exp2(sink - m_f)
        acc = acc * alpha[:, None]
    out = acc / l_i[:, None]
    tl.store(o_ptr + (q_start + local)[:, None].to(tl.int64) * stride_qt + head * stride_qh + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len: int,
                    max_seq_len: int, scale: float, *, sliding_window=None, logit_softcap=None,
                    sinks=None) -> torch.Tensor:
    """The ``paged_attention`` contract (turnout/ops/reference/attention.py)."""
    check_variants(sliding_window, logit_softcap, sinks, query.shape[1])
    query = query.contiguous()
    out = torch.empty_like(query)
    t, hq, d = query.shape
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    tiles = triton.cdiv(max(int(max_query_len), 1), ATTN_BLOCK_M)
    variants = {}  # only those in use: the default call compiles the kernel as it always was
    if sliding_window is not None:
        variants["WINDOW"] = int(sliding_window)
    if logit_softcap is not None:
        variants["SOFTCAP"] = float(logit_softcap)
    if sinks is not None:
        variants["HAS_SINKS"] = True
    _attn_kernel[(b * tiles, hq)](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale * 1.4426950408889634, tiles,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), k_cache.shape[1], hq // k_cache.shape[2], d,
        sinks.to(query.device).contiguous() if sinks is not None else query,
        BLOCK_M=ATTN_BLOCK_M, BLOCK_N=ATTN_BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(d)),
        PRECISION=_precision(query.dtype), UPCAST=_upcast(query.dtype), num_warps=4,
        num_stages=1 if _INTERPRET else 2, **variants)
    return out


def moe_experts(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The ``moe_experts`` contract (turnout/ops/reference/moe.py): fixed tiles, fixed-order slot sum."""
    if hidden.shape[0] * topk_ids.shape[1] == 0:
        return torch.zeros_like(hidden)
    pairs = grouped_pair_outputs(hidden, w13, w2, topk_weights, topk_ids, MOE_CONFIG)  # [T, k, H] f32
    return combine_slots(pairs).to(hidden.dtype)
