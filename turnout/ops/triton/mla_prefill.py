"""The decompressed latent-attention prefill's two kernels (turnout/ops/reference/mla_prefill.py states the meaning).

``mla_gather_cache``: a program per (sequence, tile of BLOCK_T positions) copies latent rows out of the paged
cache into the packed buffer, upcasting an fp8 cache and applying its scale.

``varlen_attention``: flash attention over packed contiguous keys and values, a program per (tile of BLOCK_M
queries of one sequence, head). The key head dim (DeepSeek: 128 + 64) is taken as two power-of-two parts, D_A
and D_B (two dots per score tile), so 192 is not padded to 256; the value head dim is padded to a power of two.
The KV loop of a query tile stops at the causal limit of its last row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.kv_cache import FP8_KV
from turnout.ops.triton.mla import _scale

_MAX_GRID = 65535


@triton.jit
def _gather_kernel(CACHE, TABLES, SEQ_LENS, KSL, S, OUT, stride_cb, stride_cs, stride_bt, stride_ot,
                   W: tl.constexpr, BS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                   FP8_KV: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    ctx = tl.load(SEQ_LENS + seq)
    pos = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = pos < ctx
    if tile * BLOCK_T < ctx:
        blk = tl.load(TABLES + seq * stride_bt + pos // BS, mask=ok, other=0).to(tl.int64)
        row = CACHE + blk * stride_cb + (pos % BS).to(tl.int64) * stride_cs
        dst = OUT + (tl.load(KSL + seq).to(tl.int64) + pos)[:, None] * stride_ot
        for w0 in range(0, W, BLOCK_W):
            offs = w0 + tl.arange(0, BLOCK_W)
            m = ok[:, None] & (offs < W)[None, :]
            x = tl.load(row[:, None] + offs[None, :], mask=m, other=0.0)
            if FP8_KV:
                x = x.to(tl.float32) * tl.load(S)
            tl.store(dst + offs[None, :], x.to(OUT.dtype.element_ty), mask=m)


def mla_gather_cache(latent_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     key_start_loc: torch.Tensor, max_seq_len: int, total_tokens: int, dtype: torch.dtype,
                     kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    width = latent_cache.shape[-1]
    out = torch.empty((total_tokens, width), dtype=dtype, device=latent_cache.device)
    b = seq_lens.shape[0]
    if total_tokens == 0 or b == 0:
        return out
    fp8 = latent_cache.dtype == FP8_KV
    s = _scale(kv_scale, latent_cache) if fp8 else out
    block_t = 32
    tiles = triton.cdiv(max_seq_len, block_t)
    for s0 in range(0, b, _MAX_GRID):  # sequences on the first axis: at most 65535 per launch on the others
        n = min(b - s0, _MAX_GRID)
        _gather_kernel[(n, tiles)](
            latent_cache, block_tables[s0:], seq_lens[s0:], key_start_loc[s0:], s, out, latent_cache.stride(0),
            latent_cache.stride(1), block_tables.stride(0), out.stride(0), W=width, BS=latent_cache.shape[1],
            BLOCK_T=block_t, BLOCK_W=min(128, triton.next_power_of_2(width)), FP8_KV=fp8, num_warps=4)
    return out


@triton.jit
def _varlen_kernel(Q, K, V, QSL, KSL, OUT, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_ot, stride_oh, sm_scale, D_A: tl.constexpr, D_B: tl.constexpr, DK: tl.constexpr,
                   DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr, HAS_B: tl.constexpr):
    mb = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    q0 = tl.load(QSL + seq).to(tl.int64)
    n = tl.load(QSL + seq + 1).to(tl.int64) - q0
    if mb * BLOCK_M < n:
        k0 = tl.load(KSL + seq).to(tl.int64)
        ctx = tl.load(KSL + seq + 1).to(tl.int64) - k0
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n
        visible = ctx - n + offs_m + 1  # keys each query row sees
        last = tl.minimum(ctx - n + (mb + 1) * BLOCK_M, ctx)  # the tile reads keys up to its last row's limit
        offs_a = tl.arange(0, D_A)
        a_ok = offs_a < DK
        offs_b = D_A + tl.arange(0, D_B)
        b_ok = offs_b < DK
        offs_v = tl.arange(0, BLOCK_DV)
        v_ok = offs_v < DV
        q_row = Q + (q0 + offs_m)[:, None] * stride_qt + head * stride_qh
        qa = tl.load(q_row + offs_a[None, :], mask=m_ok[:, None] & a_ok[None, :], other=0.0)
        qb = tl.load(q_row + offs_b[None, :], mask=m_ok[:, None] & b_ok[None, :], other=0.0)  # unused without B
        qk_scale = sm_scale * 1.4426950408889634  # exp2 below
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for n0 in range(0, last, BLOCK_N):
            pos = n0 + offs_n
            ok = pos < last
            k_row = K + (k0 + pos)[:, None] * stride_kt + head * stride_kh
            ka = tl.load(k_row + offs_a[None, :], mask=ok[:, None] & a_ok[None, :], other=0.0)
            s = tl.dot(qa, tl.trans(ka), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] f32
            if HAS_B:
                kb = tl.load(k_row + offs_b[None, :], mask=ok[:, None] & b_ok[None, :], other=0.0)
                s += tl.dot(qb, tl.trans(kb), input_precision=PRECISION)
            keep = ok[None, :] & (pos[None, :] < visible[:, None])
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past the sequence see nothing
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + (k0 + pos)[:, None] * stride_vt + head * stride_vh + offs_v[None, :],
                        mask=ok[:, None] & v_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptr = OUT + (q0 + offs_m)[:, None] * stride_ot + head * stride_oh + offs_v[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & v_ok[None, :])


def split_head_dim(d: int) -> tuple[int, int]:
    """(D_A, D_B): the largest power of two at most d (at least 16: a dot's minimum), and the rest padded to a
    power of two (0: none; 192 -> 128 + 64, 24 -> 16 + 16 masked to 8)."""
    a = max(16, 1 << (d.bit_length() - 1))
    rest = d - a
    return a, max(16, triton.next_power_of_2(rest)) if rest > 0 else 0


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor,
                     key_start_loc: torch.Tensor, max_query_len: int, max_key_len: int, scale: float, *,
                     tiles: dict | None = None) -> torch.Tensor:
    """``tiles``: block_m, block_n, num_warps, num_stages overrides (benchmarks/mla_prefill.py)."""
    t, heads, dk = query.shape
    dv = value.shape[-1]
    out = torch.empty((t, heads, dv), dtype=query.dtype, device=query.device)
    b = query_start_loc.shape[0] - 1
    if t == 0 or b == 0:
        return out
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    tiles = tiles or {}
    d_a, d_b = split_head_dim(dk)
    block_m = tiles.get("block_m") or (64 if max_query_len > 32 else 16)
    block_n = tiles.get("block_n") or (64 if dk + dv <= 320 else 32)
    precision = "ieee" if query.dtype == torch.float32 else None  # float32 dots exact, not tf32
    grid = (triton.cdiv(max_query_len, block_m), b, heads)
    if grid[0] > _MAX_GRID or heads > _MAX_GRID:
        raise ValueError(f"varlen_attention: grid {grid} is past the launch limits")
    for s0 in range(0, b, _MAX_GRID):
        _varlen_kernel[(grid[0], min(b - s0, _MAX_GRID), heads)](
            query, key, value, query_start_loc[s0:], key_start_loc[s0:], out, query.stride(0), query.stride(1),
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), out.stride(0), out.stride(1),
            float(scale), D_A=d_a, D_B=max(d_b, 16), DK=dk, DV=dv, BLOCK_DV=max(16, triton.next_power_of_2(dv)),
            BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, HAS_B=d_b > 0, num_warps=tiles.get("num_warps") or 4,
            num_stages=tiles.get("num_stages") or 2)
    return out
