"""Multi-head latent attention over the paged latent cache (turnout/ops/reference/mla.py states the meaning).

Decode, absorbed (the FlashMLA / Triton-MLA decode approach): every head reads the same latent vector of a token,
so one program takes ``BLOCK_H`` heads of one query token and loads each KV tile once for all of them; the score
tile is two dots, ``q_lat [BLOCK_H, L] x c^T`` and ``q_pe [BLOCK_H, R] x k_pe^T``, and the output tile
``p [BLOCK_H, N] x c [N, L]`` stays in the latent space (the layer applies W_UV). A long context is split over
``num_splits`` programs per (token, head tile) (flash-decoding); their normalised partial outputs are merged by
log-sum-exp with the paged-attention op's merge kernel (turnout/ops/triton/attention_split.py).

Any query length runs (a program per query token, each with its own causal limit), so prefill chunks are served
too, reading the context once per token: correct, and the cheap path stays the decode one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.kv_cache import FP8_KV
from turnout.ops.triton._pdl import pdl_args, pdl_wait
from turnout.ops.triton._tuning import interpreted
from turnout.ops.triton.attention_split import _MAX_SPLITS, _num_sms, _split_reduce_kernel
from turnout.ops.triton.cache import quantize_kv

ROUND_FP8 = interpreted()  # the interpreter's fp8 cast needs values already on the e4m3 grid (cache.py)
_MAX_GRID_Y = 65535


@triton.jit
def _mla_cache_kernel(KV_C, K_PE, CACHE, SLOTS, S, stride_ct, stride_pt, stride_cb, stride_cs,
                      L: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, BLOCK_L: tl.constexpr,
                      BLOCK_R: tl.constexpr, PDL: tl.constexpr, FP8_KV: tl.constexpr = False,
                      ROUND: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        dst = CACHE + (slot // BS) * stride_cb + (slot % BS) * stride_cs
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        c = tl.load(KV_C + t * stride_ct + offs_l, mask=offs_l < L)
        p = tl.load(K_PE + t * stride_pt + offs_r, mask=offs_r < R)
        c = quantize_kv(c, S, FP8_KV, ROUND)
        p = quantize_kv(p, S, FP8_KV, ROUND)
        tl.store(dst + offs_l, c.to(CACHE.dtype.element_ty), mask=offs_l < L)
        tl.store(dst + L + offs_r, p.to(CACHE.dtype.element_ty), mask=offs_r < R)


def mla_reshape_and_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    t, lat = kv_c.shape
    rope = k_pe.shape[-1]
    if t == 0:
        return
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1:
        kv_c, k_pe = kv_c.contiguous(), k_pe.contiguous()
    fp8 = latent_cache.dtype == FP8_KV
    scale = _scale(kv_scale, latent_cache) if fp8 else kv_c
    _mla_cache_kernel[(t,)](kv_c, k_pe, latent_cache, slot_mapping, scale, kv_c.stride(0), k_pe.stride(0),
                            latent_cache.stride(0), latent_cache.stride(1), L=lat, R=rope,
                            BS=latent_cache.shape[1], BLOCK_L=triton.next_power_of_2(lat),
                            BLOCK_R=triton.next_power_of_2(max(rope, 1)), FP8_KV=fp8, ROUND=fp8 and ROUND_FP8,
                            **pdl_args(kv_c))


def _scale(kv_scale, cache):
    if kv_scale is None:
        return torch.ones(1, dtype=torch.float32, device=cache.device)
    return kv_scale.float().reshape(-1)[:1]


@triton.jit
def _mla_decode_kernel(Q_LAT, Q_PE, CACHE, TABLES, SEQ_LENS, QSL, TOKEN_SEQ, PROG_SEQ, PROG_TOK, S, OUT, LSE,
                       stride_qt, stride_qh, stride_pt, stride_ph, stride_cb, stride_cs, stride_bt,
                       stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                       num_heads, sm_scale, t0, L: tl.constexpr, R: tl.constexpr, BS: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr, QB: tl.constexpr = 1,
                       FP8_KV: tl.constexpr = False):
    """Rows are (query token, head) pairs: QB consecutive tokens of one sequence times BLOCK_H heads. QB = 1: the
    program's token is its grid index (TOKEN_SEQ gives its sequence); QB > 1 (prefill chunks, never split): its
    sequence and first token are PROG_SEQ / PROG_TOK (-1: no work)."""
    pdl_wait(PDL)
    # head tiles on the fastest grid axis: the programs that read one token's context run side by side, so its
    # latent tiles come from DRAM once and from L2 for the other head tiles
    hb = tl.program_id(0)
    prog = tl.program_id(1).to(tl.int64) + t0
    split = tl.program_id(2)
    if QB == 1:
        first = prog
        seq = tl.load(TOKEN_SEQ + prog).to(tl.int64)
    else:
        seq = tl.load(PROG_SEQ + prog).to(tl.int64)
        first = tl.load(PROG_TOK + prog).to(tl.int64)
    if seq >= 0:
        ctx = tl.load(SEQ_LENS + seq)
        q0 = tl.load(QSL + seq).to(tl.int64)
        q1 = tl.load(QSL + seq + 1).to(tl.int64)
        offs_m = tl.arange(0, QB * BLOCK_H)
        tok = first + offs_m // BLOCK_H
        head = hb * BLOCK_H + offs_m % BLOCK_H
        row_ok = (tok < q1) & (head < num_heads)
        tok = tl.minimum(tok, q1 - 1)  # rows past the sequence repeat its last token (never stored)
        # keys each row attends: positions [0, ctx - q_len + its index + 1); the program reads up to the widest
        row_visible = (ctx - (q1 - q0) + (tok - q0) + 1).to(tl.int32)
        visible = tl.max(row_visible, 0)
        per_split = tl.cdiv(tl.cdiv(visible, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, visible)

        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        h_ok = head < num_heads
        l_ok = offs_l < L
        r_ok = offs_r < R
        q_lat = tl.load(Q_LAT + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_l[None, :],
                        mask=h_ok[:, None] & l_ok[None, :], other=0.0)
        q_pe = tl.load(Q_PE + tok[:, None] * stride_pt + head[:, None] * stride_ph + offs_r[None, :],
                       mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        qk_scale = sm_scale * 1.4426950408889634  # exp2 below
        if FP8_KV:
            qk_scale = qk_scale * tl.load(S)  # scores are linear in the cache values: the scale folds in here
        m_i = tl.full([QB * BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([QB * BLOCK_H], tl.float32)
        acc = tl.zeros([QB * BLOCK_H, BLOCK_L], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            ok = pos < end
            blk = tl.load(TABLES + seq * stride_bt + pos // BS, mask=ok, other=0).to(tl.int64)
            row = CACHE + blk * stride_cb + (pos % BS) * stride_cs
            c = tl.load(row[:, None] + offs_l[None, :], mask=ok[:, None] & l_ok[None, :], other=0.0)
            k_pe = tl.load(row[:, None] + L + offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
            if FP8_KV:
                c = c.to(Q_LAT.dtype.element_ty)
                k_pe = k_pe.to(Q_LAT.dtype.element_ty)
            s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION) + \
                tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)  # [rows, BLOCK_N] f32
            # every row sees key 0 in the first tile (start = 0 whenever QB > 1): no row is all -inf there
            keep = ok[None, :] & (pos[None, :] < row_visible[:, None])
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
            m_i = m_new
        if FP8_KV:
            acc = acc * tl.load(S)  # the values' scale, once
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        out = acc / safe_l[:, None]
        o_ptr = OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + offs_l[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & l_ok[None, :])
        if NUM_SPLITS > 1:  # lse in log2 units (what the merge kernel takes); an empty split gives -inf
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            tl.store(LSE + tok * stride_lt + head * stride_lh + split, lse, mask=row_ok)


def choose_mla_splits(tokens: int, head_tiles: int, max_query_len: int, max_seq_len: int, num_sms: int,
                      block_n: int) -> int:
    """Programs per (token, head tile): enough to give every SM two programs at decode, one per 4 KV tiles at
    most (a split must amortise its merge); prefill never splits. Host ints only (no device sync)."""
    if max_query_len > 1:
        return 1
    programs = tokens * head_tiles
    if programs >= 2 * num_sms:
        return 1
    want = triton.cdiv(2 * num_sms, programs)
    return max(1, min(want, triton.cdiv(max_seq_len, 4 * block_n), _MAX_SPLITS))


def _prefill_programs(query_start_loc: torch.Tensor, tokens: int, qb: int):
    """(sequence [P] i32, first token [P] i32, P) of each program taking ``qb`` consecutive new tokens of one
    sequence; P = ceil(tokens / qb) + batch bounds the sum over sequences, so it is a host int, and the device
    computes which program is which (no sync). Programs past the last sequence's get sequence -1."""
    qsl = query_start_loc.to(torch.int64)
    b = qsl.shape[0] - 1
    per_seq = (qsl[1:] - qsl[:-1] + qb - 1) // qb
    ends = torch.cumsum(per_seq, 0)
    programs = -(-tokens // qb) + b
    prog = torch.arange(programs, device=qsl.device)
    seq = torch.searchsorted(ends, prog, right=True)
    seq_c = seq.clamp(max=b - 1)
    first = qsl[seq_c] + (prog - (ends[seq_c] - per_seq[seq_c])) * qb
    return torch.where(seq < b, seq_c, -1).to(torch.int32), first.to(torch.int32), programs


def mla_paged_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        max_query_len: int, max_seq_len: int, scale: float,
                        kv_scale: torch.Tensor | None = None, *, num_splits: int | None = None,
                        tiles: dict | None = None) -> torch.Tensor:
    """``num_splits``: the policy's choice (None: ``choose_mla_splits``). ``tiles``: any of block_h, block_n,
    num_warps, num_stages, qb (query tokens per program at prefill), overriding the built-in launch
    (benchmarks/mla_decode.py sweeps them)."""
    t, heads, lat = q_lat.shape
    rope = q_pe.shape[-1]
    out = torch.empty_like(q_lat)
    if t == 0:
        return out
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1:
        q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
    # each token's sequence, on the device (no host sync: a captured graph replays it)
    token_seq = torch.searchsorted(query_start_loc[1:].to(torch.int32),
                                   torch.arange(t, device=q_lat.device, dtype=torch.int32), right=True)
    tiles = tiles or {}
    block_h = tiles.get("block_h") or 16
    block_n = tiles.get("block_n") or (32 if lat <= 256 or latent_cache.element_size() == 1 else 16)
    head_tiles = triton.cdiv(heads, block_h)
    splits = num_splits or choose_mla_splits(t, head_tiles, max_query_len, max_seq_len,
                                              _num_sms(q_lat.device.type, q_lat.device.index), block_n)
    # prefill chunks: QB query tokens of a sequence per program, so one latent tile feeds QB x block_h rows of
    # the matrix units (rows of 32 at the 512-wide latent: a wider accumulator would not stay in registers)
    qb = tiles.get("qb") or (1 if max_query_len == 1 or splits > 1 else max(1, (64 if lat <= 256 else 32) // block_h))
    if qb & (qb - 1):
        raise ValueError(f"mla_paged_attention: tiles qb={qb} must be a power of two (rows of qb x block_h)")
    if qb > 1:
        splits = 1
        prog_seq, prog_tok, programs = _prefill_programs(query_start_loc, t, qb)
    else:
        prog_seq = prog_tok = token_seq
        programs = t
    fp8 = latent_cache.dtype == FP8_KV
    s = _scale(kv_scale, latent_cache) if fp8 else q_lat
    block_l = triton.next_power_of_2(lat)
    if splits > 1:
        ws_o = torch.empty((t, heads, splits, lat), dtype=torch.float32, device=q_lat.device)
        ws_lse = torch.empty((t, heads, splits), dtype=torch.float32, device=q_lat.device)
        o, so = ws_o, (ws_o.stride(0), ws_o.stride(1), ws_o.stride(2))
    else:
        ws_lse = q_lat  # unused
        o, so = out, (out.stride(0), out.stride(1), 0)
    precision = "ieee" if q_lat.dtype == torch.float32 else None  # float32 dots exact, not tf32
    warps = tiles.get("num_warps") or (8 if lat >= 256 else 4)
    for t0 in range(0, programs, _MAX_GRID_Y):  # the grid's second axis holds at most 65535 programs
        _mla_decode_kernel[(head_tiles, min(programs - t0, _MAX_GRID_Y), splits)](
            q_lat, q_pe, latent_cache, block_tables, seq_lens, query_start_loc, token_seq, prog_seq, prog_tok, s, o,
            ws_lse,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), latent_cache.stride(0),
            latent_cache.stride(1), block_tables.stride(0), *so,
            ws_lse.stride(0) if splits > 1 else 0, ws_lse.stride(1) if splits > 1 else 0,
            heads, float(scale), t0, L=lat, R=rope, BS=latent_cache.shape[1], BLOCK_H=block_h, BLOCK_L=block_l,
            BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_N=block_n, NUM_SPLITS=splits, PRECISION=precision,
            QB=qb, FP8_KV=fp8, num_warps=warps, num_stages=tiles.get("num_stages") or 2,
            **pdl_args(q_lat, "attention"))
    if splits > 1:
        _split_reduce_kernel[(t, heads)](
            ws_o, ws_lse, out, splits, ws_o.stride(0), ws_o.stride(1), ws_o.stride(2), ws_lse.stride(0),
            ws_lse.stride(1), out.stride(0), out.stride(1), out, S_PAD=triton.next_power_of_2(splits),
            HEAD_D=lat, D_PAD=block_l,
            **pdl_args(q_lat, "attention_merge"))
    return out
