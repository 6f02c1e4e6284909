"""Paged attention: causal attention of new tokens over a paged KV cache (decode and prefill with prefix).

One program owns a tile of query tokens of one sequence and *all* the query heads of one KV head (GQA),
so each KV tile it loads serves every head that shares it. Rows of the program's [BLOCK_M, D] query tile
are (token, head) pairs: row r is token r // G_TILE, head r % G_TILE of the group. The KV loop visits
BLOCK_N tokens (several cache blocks) per iteration, gathering them through the block table, with an
online softmax in float32 (base 2) and ``tl.dot`` for QK^T and PV.

Decode with few sequences and long contexts leaves most of the GPU idle with one program per
(sequence, KV head), so it splits the context across programs (flash-decoding): each split writes a
normalised partial output and its log-sum-exp, and a second kernel merges them (both in
turnout/ops/triton/attention_split.py). Whether to split is
chosen from host ints (batch size, KV heads, max_seq_len, the SM count), so there is no device sync.
The split count is the implementation's declared choice ``num_splits`` (turnout/ops/triton/__init__.py:
CHOICES): ``turnout ops`` shows it and ``TURNOUT_OPS="paged_attention.num_splits=1"`` fixes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_args, pdl_wait
from turnout.ops.triton._tuning import attn_decode
from turnout.ops.triton.attention_split import _SPLIT_MAX_Q, _num_sms, _split_reduce_kernel, choose_num_splits
from turnout.ops.triton.cache import ROUND_FP8, fp8_kv_args, quantize_kv

LOG2E = 1.4426950408889634

# An fp8 cache's V read as 16-bit pairs of columns (the kernel's V_PAIRS), in one-token (decode) tiles only: with
# prefill tiles (BLOCK_Q > 1) the pairs gave wrong outputs on the H200 in one conformance case (D 64, 7 and 3 new
# tokens over 40 and 19: max error 1.0, where the interpreter matches the reference) and an illegal address in
# another, under Triton 3.6; the decode tiles pass every case there. benchmarks/fp8_kv.py turns it off to time the
# byte-wise tile beside it.
V_PAIRS = True
TUNING_ENV = "TURNOUT_ATTN_DECODE"  # {"num_splits", "block_n", "num_warps", "num_stages"} (_tuning.py)


@triton.jit
def _rope_layout(offs_d, ROT: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Per head dim d: the dim it rotates with, the cos/sin index, the sign of the partner's sin term, and
    whether d rotates at all (d >= ROT passes through): o[d] = y[d] cos + sign y[partner] sin."""
    if IS_NEOX:
        first = offs_d < HALF
        partner = tl.where(first, offs_d + HALF, offs_d - HALF)
        ci = tl.where(first, offs_d, offs_d - HALF)
    else:
        first = offs_d % 2 == 0
        partner = tl.where(first, offs_d + 1, offs_d - 1)
        ci = offs_d // 2
    rot = offs_d < ROT
    return tl.where(rot, partner, offs_d), tl.where(rot, ci, 0), tl.where(first, -1.0, 1.0), rot


@triton.jit
def _norm_rope_rows(rows, ok, offs_d, partner, sign, rot, cos, sin, W, eps, HEAD_D: tl.constexpr,
                    HAS_NORM: tl.constexpr):
    """Rows [R, D_PAD] of raw q or k (``rows`` [R, 1] pointers) -> RMSNorm over the head (with weight W) and
    RoPE, rounded as ``qk_norm_rotary`` / ``rotary_embedding`` round: normalised in fp32, rounded to the
    input dtype, scaled, rounded, rotated in fp32, rounded."""
    d_ok = offs_d < HEAD_D
    m = ok & d_ok[None, :]
    x = tl.load(rows + offs_d[None, :], mask=m, other=0.0)
    xp = tl.load(rows + partner[None, :], mask=m, other=0.0)
    dt = x.dtype
    y = x.to(tl.float32)
    yp = xp.to(tl.float32)
    if HAS_NORM:
        r = (1.0 / tl.sqrt(tl.sum(y * y, 1) / HEAD_D + eps))[:, None]
        w = tl.load(W + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(W + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        y = (w * (y * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        yp = (wp * (yp * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return tl.where(rot[None, :], y * cos[None, :] + sign[None, :] * (yp * sin[None, :]), y).to(dt)


@triton.jit
def _paged_attn_kernel(
        Q, K, V, O, BT, SEQ_LENS, QSL, WS_O, WS_LSE,
        qk_scale, num_splits,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_bt, stride_wt, stride_wh, stride_ws, stride_lt, stride_lh,
        POS, CS, QW, KW, KN, VN, SLOTS, eps, stride_cs, stride_knt, stride_knh, stride_vnt, stride_vnh, KS, VS,
        G: tl.constexpr, G_TILE: tl.constexpr, NUM_HEAD_TILES: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, HEAD_D: tl.constexpr,
        D_PAD: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr,
        HAS_NORM: tl.constexpr, IS_NEOX: tl.constexpr, ROT: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr,
        ONE_TOKEN: tl.constexpr = False, FP8_KV: tl.constexpr = False, ROUND: tl.constexpr = False,
        F16_DOT: tl.constexpr = False, V_PAIRS: tl.constexpr = False):
    """With ROPE (decode, one new token per sequence): Q, KN and VN are the raw q, k and v of the new tokens;
    each program normalises and rotates its q rows itself, and the program whose KV range holds the new
    position also normalises, rotates and writes the new k and v into the cache before reading it.
    ONE_TOKEN (the host knows T == B and max_query_len == 1, so query_start_loc is 0, 1, 2, ...): sequence b's
    token is token b, and the first loads (its length, position, slot, q) do not wait on query_start_loc.
    FP8_KV: the cache is e4m3fn with per-tensor scales KS / VS: a tile is upcast to q's dtype as it is loaded, the
    key scale is folded into the score scale and the value scale into the final normalisation (exact: each is
    one number), and the new k / v of the ROPE path are quantised as reshape_and_cache does.
    F16_DOT (an fp8 cache with 16-bit q): both dots in float16. e4m3 converts to float16 exactly at one instruction
    per two values; bfloat16 tiles took that plus one f16 -> bf16 conversion per value (the sm90 PTX), and the
    fp8 cache was read at 1,041 GB/s against the bf16 cache's 3,147 at 64 x 4096 on the H200 (docs/benchmarks.md,
    twelfth session). q is scaled by a power of two when its largest element would not fit float16 (the score
    scale divides it back out, exactly); p <= 1 fits.
    V_PAIRS (F16_DOT, one-token tiles, an even head dim): V loaded as 16-bit pairs of columns (2j, 2j + 1). An fp8 V
    tile reached the PV dot through byte-wise shared-memory loads (sm90's ldmatrix transposes 16-bit elements, not
    bytes: 64 ld.shared.b8 a thread and iteration in the PTX); as pairs it is transposed by ldmatrix.trans and its
    low and high bytes feed two dots (even and odd output columns, stored as two strided halves). 64 x 4096 on the
    H200: 0.313 -> 0.195 ms."""
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    q_tile = tl.program_id(0)
    b = tl.program_id(1)
    pid2 = tl.program_id(2)
    split = pid2 % num_splits
    kvh = pid2 // num_splits // NUM_HEAD_TILES
    head_tile = pid2 // num_splits % NUM_HEAD_TILES

    if ONE_TOKEN:  # every sequence has exactly one new token: token b is sequence b's (no dependent load)
        q_start = b
        q_len = 1
    else:
        q_start = tl.load(QSL + b)
        q_len = tl.load(QSL + b + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        kv_len = tl.load(SEQ_LENS + b)
        rows = tl.arange(0, BLOCK_M)
        tok = q_tile * BLOCK_Q + rows // G_TILE  # index among this sequence's new tokens
        hh = head_tile * G_TILE + rows % G_TILE  # head within the GQA group
        row_ok = (rows // G_TILE < BLOCK_Q) & (tok < q_len) & (hh < G)
        head = kvh * G + hh
        qpos = kv_len - q_len + tok  # absolute position: attends to keys 0..qpos
        q_row = (q_start + tok).to(tl.int64)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < HEAD_D
        q_ptrs = Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh
        if ROPE:  # one new token (BLOCK_Q == 1): its position and rotation serve q and the new k
            partner, ci, sign, rot = _rope_layout(offs_d, ROT, HALF, IS_NEOX)
            cs_row = CS + tl.load(POS + q_start).to(tl.int64) * stride_cs
            cos = tl.load(cs_row + ci, mask=rot, other=1.0).to(tl.float32)
            sin = tl.load(cs_row + HALF + ci, mask=rot, other=0.0).to(tl.float32)
            q = _norm_rope_rows(q_ptrs, row_ok[:, None], offs_d, partner, sign, rot, cos, sin, QW, eps, HEAD_D,
                                HAS_NORM)
        else:
            q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        # Keys this tile needs: up to the last valid token's position (causal), within this split.
        kv_hi = kv_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
        kv_lo = 0
        if SPLIT:  # decode: this sequence's context in num_splits chunks of whole KV tiles (the last
            # splits of a short context are empty: they store lse = -inf, which the merge weighs 0)
            chunk = tl.cdiv(tl.cdiv(kv_hi, num_splits), BLOCK_N) * BLOCK_N
            kv_lo = split * chunk
            kv_hi = tl.minimum(kv_hi, kv_lo + chunk)
        if ROPE:  # the program that reads the new position writes it (its head tiles write the same bytes)
            new_slot = tl.load(SLOTS + q_start).to(tl.int64)
            if (new_slot >= 0) & (kv_len - 1 >= kv_lo) & (kv_len - 1 < kv_hi):
                one = tl.full([1, 1], 1, tl.int1)
                k_new = _norm_rope_rows(KN + q_start.to(tl.int64) * stride_knt + kvh * stride_knh + tl.zeros(
                    [1, 1], tl.int64), one, offs_d, partner, sign, rot, cos, sin, KW, eps, HEAD_D, HAS_NORM)
                v_new = tl.load(VN + q_start.to(tl.int64) * stride_vnt + kvh * stride_vnh + offs_d, mask=d_ok)
                blk, off = new_slot // BS, new_slot % BS
                tl.store(K + blk * stride_kb + off * stride_ks + kvh * stride_kh + offs_d[None, :],
                         quantize_kv(k_new, KS, FP8_KV, ROUND).to(K.dtype.element_ty), mask=d_ok[None, :])
                tl.store(V + blk * stride_vb + off * stride_vs + kvh * stride_vh + offs_d,
                         quantize_kv(v_new, VS, FP8_KV, ROUND).to(V.dtype.element_ty), mask=d_ok)
            tl.debug_barrier()  # the block's own cache writes are visible to all its threads before the loop

        s_scale = qk_scale
        if FP8_KV:
            s_scale = qk_scale * tl.load(KS)
        if F16_DOT:
            q_abs = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
            q_mult = tl.exp2(tl.minimum(14.0 - tl.ceil(tl.log2(tl.maximum(q_abs, 1e-30))), 0.0))  # 1 unless > 2^14
            q = (q.to(tl.float32) * q_mult).to(tl.float16)
            s_scale = s_scale / q_mult
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_M, D_PAD // 2], dtype=tl.float32)  # V_PAIRS: the odd columns (acc: the even)
        bt_row = BT + b.to(tl.int64) * stride_bt
        k_head = K + kvh.to(tl.int64) * stride_kh
        v_head = V + kvh.to(tl.int64) * stride_vh
        if V_PAIRS:
            acc = tl.zeros([BLOCK_M, D_PAD // 2], dtype=tl.float32)
            v_pairs = v_head.to(tl.pointer_type(tl.uint16))
            offs_p = tl.arange(0, D_PAD // 2)
            p_ok = offs_p < HEAD_D // 2
        for start in range(kv_lo, kv_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_hi
            page = tl.load(bt_row + offs_n // BS, mask=n_ok, other=0).to(tl.int64)
            slot = offs_n % BS
            if HEAD_D == D_PAD:  # no mask across the head dim: keeps the loads vectorised
                k_mask = n_ok[None, :]
                v_mask = n_ok[:, None]
            else:
                k_mask = n_ok[None, :] & d_ok[:, None]
                v_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_head + (page * stride_kb + slot * stride_ks)[None, :] + offs_d[:, None],
                        mask=k_mask, other=0.0)  # [D_PAD, BLOCK_N]
            s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * s_scale
            s = tl.where(n_ok[None, :] & (offs_n[None, :] <= qpos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays at 0
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            if V_PAIRS:  # V as 16-bit pairs (columns 2j, 2j + 1): the tile reaches the dot as 16-bit values,
                # which the hardware transposes (ldmatrix.trans); then each half is its own dot's operand
                vp = tl.load(v_pairs + ((page * stride_vb + slot * stride_vs) // 2)[:, None] + offs_p[None, :],
                             mask=n_ok[:, None] & p_ok[None, :], other=0)  # [BLOCK_N, D_PAD // 2]
                v_lo = (vp & 0xFF).to(tl.uint8).to(K.dtype.element_ty, bitcast=True).to(tl.float16)
                v_hi = (vp >> 8).to(tl.uint8).to(K.dtype.element_ty, bitcast=True).to(tl.float16)
                p16 = p.to(tl.float16)
                acc = acc * alpha[:, None] + tl.dot(p16, v_lo, input_precision=PRECISION)
                acc_hi = acc_hi * alpha[:, None] + tl.dot(p16, v_hi, input_precision=PRECISION)
            else:
                v = tl.load(v_head + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :],
                            mask=v_mask, other=0.0)  # [BLOCK_N, D_PAD]
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        out_hi = acc_hi / l_safe[:, None]
        if FP8_KV:
            out = out * tl.load(VS)
            out_hi = out_hi * tl.load(VS)
        if V_PAIRS:  # out holds the even columns 2j, out_hi the odd ones 2j + 1 (stored in two strided halves)
            cols = 2 * offs_p
            mask = row_ok[:, None] & p_ok[None, :]
        else:
            cols = offs_d
            mask = row_ok[:, None] & d_ok[None, :]
        if SPLIT:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            ws = WS_O + q_row[:, None] * stride_wt + head[:, None] * stride_wh + split * stride_ws + cols[None, :]
            tl.store(ws, out, mask=mask)
            if V_PAIRS:
                tl.store(ws + 1, out_hi, mask=mask)
            tl.store(WS_LSE + q_row * stride_lt + head * stride_lh + split, lse, mask=row_ok)
        else:
            o = O + q_row[:, None] * stride_ot + head[:, None] * stride_oh + cols[None, :]
            tl.store(o, out.to(O.dtype.element_ty), mask=mask)
            if V_PAIRS:
                tl.store(o + 1, out_hi.to(O.dtype.element_ty), mask=mask)


def _tiles(max_query_len: int, group: int, head_dim: int) -> dict:
    """Tile sizes: decode uses one token per program (rows = the GQA group, padded to 16 for tl.dot);
    prefill packs BLOCK_M // group tokens per program. Over an fp8 cache a 128-token decode tile with 3 stages
    (TURNOUT_ATTN_DECODE='{"block_n": 128, "num_stages": 3}') read Qwen3-8B's geometry 6-9 % faster on the H200
    (0.195 -> 0.177 ms at 64 x 4096, 0.210 -> 0.198 ms at 256 x 1280; docs/benchmarks.md, thirteenth session); it
    is not the default because its conformance has not run on a GPU yet (the 64-token tile's has)."""
    g_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if d_pad <= 128 else 32
    if max_query_len <= 1:
        g_tile = min(g_pad, 64)
        return dict(G_TILE=g_tile, BLOCK_Q=1, BLOCK_M=max(16, g_tile), BLOCK_N=block_n, D_PAD=d_pad,
                    num_warps=4, num_stages=2)
    block_m = 128 if d_pad <= 64 else 64
    g_tile = min(g_pad, block_m)
    return dict(G_TILE=g_tile, BLOCK_Q=block_m // g_tile, BLOCK_M=block_m, BLOCK_N=block_n, D_PAD=d_pad,
                num_warps=4, num_stages=2)


def paged_attention_impl(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         max_query_len: int, max_seq_len: int, scale: float,
                         num_splits: int | None = None, rope: tuple | None = None, k_scale=None,
                         v_scale=None) -> torch.Tensor:
    """paged_attention with the split count exposed (None: choose; 1: never split). ``rope`` (decode only):
    (positions, key, value, q_weight, k_weight, eps, cos_sin_cache, is_neox, slot_mapping) of
    ``rotary_paged_attention``; then ``query`` is the raw q and the kernel does the rest. k_scale / v_scale:
    an fp8 cache's (turnout/ops/kv_cache.py)."""
    num_tokens, hq, head_dim = query.shape
    out = torch.empty((num_tokens, hq, head_dim), dtype=query.dtype, device=query.device)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_query_len <= 0:
        return out
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs a unit stride on the head dimension")
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    group = hq // hk
    ks, vs, fp8 = fp8_kv_args(k_cache, k_scale, v_scale, query)
    f16_dot = fp8 and query.dtype in (torch.bfloat16, torch.float16)
    v_pairs = (f16_dot and V_PAIRS and max_query_len <= 1 and head_dim % 2 == 0 and head_dim > 16
               and all(st % 2 == 0 for st in v_cache.stride()[:3]))  # whole 16-bit pairs
    cfg = _tiles(max_query_len, group, head_dim)
    num_head_tiles = triton.cdiv(group, cfg["G_TILE"])
    if max_query_len <= _SPLIT_MAX_Q:
        tuning = attn_decode()  # validated by turnout.envs
        cfg.update({key.upper() if key == "block_n" else key: tuning[key]
                    for key in ("block_n", "num_warps", "num_stages") if key in tuning})
        if num_splits is None:
            num_splits = tuning.get("num_splits")
    if num_splits is None:
        num_splits = choose_num_splits(batch, hk * num_head_tiles, max_query_len, max_seq_len,
                                       _num_sms(query.device.type, query.device.index), cfg["BLOCK_N"])
    num_splits = min(num_splits, triton.cdiv(max_seq_len, cfg["BLOCK_N"]))  # no more splits than KV tiles
    split = num_splits > 1
    if split:
        ws_o = torch.empty((num_tokens, hq, num_splits, head_dim), dtype=torch.float32, device=query.device)
        ws_lse = torch.empty((num_tokens, hq, num_splits), dtype=torch.float32, device=query.device)
    else:
        num_splits = 1
        ws_o, ws_lse = out.view(num_tokens, hq, 1, head_dim), out  # unused
    precision = "ieee" if query.dtype == torch.float32 else None  # None: the target's default for half types
    grid = (triton.cdiv(max_query_len, cfg["BLOCK_Q"]), batch, hk * num_head_tiles * num_splits)
    if rope is not None:
        if cfg["BLOCK_Q"] != 1:
            raise ValueError("paged attention with RoPE fused takes one new token per sequence (decode)")
        positions, key, value, q_weight, k_weight, eps, cos_sin_cache, is_neox, slot_mapping = rope
        if key.stride(-1) != 1 or value.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
            raise ValueError("rotary_paged_attention needs a unit stride on the head dimension")
        rot_dim = cos_sin_cache.shape[-1]
        rope_args = (positions, cos_sin_cache, q_weight if q_weight is not None else query,
                     k_weight if k_weight is not None else query, key, value, slot_mapping, float(eps),
                     cos_sin_cache.stride(0), key.stride(0), key.stride(1), value.stride(0), value.stride(1))
        rope_consts = dict(ROPE=True, HAS_NORM=q_weight is not None, IS_NEOX=bool(is_neox), ROT=rot_dim,
                           HALF=rot_dim // 2)
    else:
        rope_args = (query,) * 7 + (0.0,) + (0,) * 5
        rope_consts = dict(ROPE=False, HAS_NORM=False, IS_NEOX=True, ROT=1, HALF=1)
    _paged_attn_kernel[grid](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, ws_o, ws_lse,
        scale * LOG2E, num_splits,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0), ws_o.stride(0), ws_o.stride(1), ws_o.stride(2), ws_lse.stride(0), ws_lse.stride(1),
        *rope_args, ks, vs,
        G=group, G_TILE=cfg["G_TILE"], NUM_HEAD_TILES=num_head_tiles, BLOCK_Q=cfg["BLOCK_Q"],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BS=block_size, HEAD_D=head_dim, D_PAD=cfg["D_PAD"],
        SPLIT=split, PRECISION=precision, **rope_consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        ONE_TOKEN=max_query_len == 1 and num_tokens == batch, FP8_KV=fp8, ROUND=fp8 and ROUND_FP8,
        F16_DOT=f16_dot, V_PAIRS=v_pairs, **pdl_args(query, "attention"))
    if split:
        _split_reduce_kernel[(num_tokens, hq)](
            ws_o, ws_lse, out, num_splits, ws_o.stride(0), ws_o.stride(1), ws_o.stride(2), ws_lse.stride(0),
            ws_lse.stride(1), out.stride(0), out.stride(1), S_PAD=triton.next_power_of_2(num_splits),
            HEAD_D=head_dim, D_PAD=cfg["D_PAD"], num_warps=4, **pdl_args(query, "attention_merge"))
    return out


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
                    num_splits: int | None = None) -> torch.Tensor:
    """``num_splits`` (the policy's ``paged_attention.num_splits``, bound once by the op table): None chooses;
    it applies to decode only (prefill is never split)."""
    if max_query_len > _SPLIT_MAX_Q:
        num_splits = None
    return paged_attention_impl(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                                max_seq_len, scale, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)


def rotary_paged_attention(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                           cos_sin_cache: torch.Tensor, is_neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                           scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           *, num_splits: int | None = None) -> torch.Tensor:
    """See turnout/ops/reference/attention.py. Decode (one new token per sequence): one attention kernel
    that also normalises and rotates q and the new k and writes k and v into the cache. Otherwise the
    separate kernels, on copies of q and k (the op leaves its inputs alone)."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rotary_paged_attention: give both q_weight and k_weight, or neither")
    if max_query_len == 1 and query.shape[0] > 0:
        if q_weight is not None:
            q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
        return paged_attention_impl(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                                    max_seq_len, scale, num_splits=num_splits,
                                    rope=(positions, key, value, q_weight, k_weight, eps, cos_sin_cache, is_neox,
                                          slot_mapping), k_scale=k_scale, v_scale=v_scale)
    from turnout.ops.triton.cache import reshape_and_cache
    from turnout.ops.triton.rotary import qk_norm_rotary_cache, rotary_embedding

    q, k = query.clone(), key.clone()
    if q_weight is not None:
        qk_norm_rotary_cache(positions, q, k, value, q_weight, k_weight, eps, cos_sin_cache, is_neox, k_cache,
                             v_cache, slot_mapping, k_scale, v_scale)
    else:
        rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
        reshape_and_cache(k, value.contiguous(), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                           scale, k_scale, v_scale, num_splits=num_splits)
