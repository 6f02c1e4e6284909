"""The paged attention kernel (device code) of turnout/ops/triton/attention.py, which chooses its tiles, splits and
variants on the host and launches it.

One program owns a tile of query tokens of one sequence and *all* the query heads of one KV head (GQA),
so each KV tile it loads serves every head that shares it. Rows of the program's [BLOCK_M, D] query tile
are (token, head) pairs: row r is token r // G_TILE, head r % G_TILE of the group. The KV loop visits
BLOCK_N tokens (several cache blocks) per iteration, gathering them through the block table, with an
online softmax in float32 (base 2) and ``tl.dot`` for QK^T and PV.
"""

from __future__ import annotations

import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_wait
from turnout.ops.triton.cache import quantize_kv

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    """tanh from one exp2 (Triton has no portable tanh): 1 - 2 / (e^2x + 1), saturating to +-1."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


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
        POS, CS, QW, KW, KN, VN, SLOTS, eps, stride_cs, stride_knt, stride_knh, stride_vnt, stride_vnh, KS, VS, SINKS,
        G: tl.constexpr, G_TILE: tl.constexpr, NUM_HEAD_TILES: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, HEAD_D: tl.constexpr,
        D_PAD: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr,
        HAS_NORM: tl.constexpr, IS_NEOX: tl.constexpr, ROT: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr,
        ONE_TOKEN: tl.constexpr = False, FP8_KV: tl.constexpr = False, ROUND: tl.constexpr = False,
        F16_DOT: tl.constexpr = False, V_PAIRS: tl.constexpr = False, WINDOW: tl.constexpr = 0,
        SOFTCAP: tl.constexpr = 0.0, HAS_SINKS: tl.constexpr = False):
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
    "fp8 one-row and one-token kernels, fp8 KV at full concurrency"). q is scaled by a power of two when its largest element would not fit float16 (the score
    scale divides it back out, exactly); p <= 1 fits.
    V_PAIRS (F16_DOT, one-token tiles, an even head dim): V loaded as 16-bit pairs of columns (2j, 2j + 1). An fp8 V
    tile reached the PV dot through byte-wise shared-memory loads (sm90's ldmatrix transposes 16-bit elements, not
    bytes: 64 ld.shared.b8 a thread and iteration in the PTX); as pairs it is transposed by ldmatrix.trans and its
    low and high bytes feed two dots (even and odd output columns, stored as two strided halves). 64 x 4096 on the
    H200: 0.313 -> 0.195 ms.
    WINDOW (> 0: a sliding window of that many keys), SOFTCAP (> 0: scores = c tanh(scores / c)) and HAS_SINKS (a
    per-head sink logit in SINKS joins the softmax denominator; with SPLIT the merge adds it): the variants of
    turnout/ops/reference/attention_variants.py. With a window the KV loop starts at the tile's first window
    position, so decode costs the window, not the context, and no key before it is ever loaded. At their defaults
    none of this is compiled in."""
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
        if WINDOW > 0:  # the first key the tile's first query may read; earlier blocks may be freed
            kv_lo = tl.maximum(kv_len - q_len + q_tile * BLOCK_Q - WINDOW + 1, 0)
        if SPLIT:  # decode: this sequence's context in num_splits chunks of whole KV tiles (the last
            # splits of a short context are empty: they store lse = -inf, which the merge weighs 0)
            if WINDOW > 0:
                chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_splits), BLOCK_N) * BLOCK_N
                kv_lo = kv_lo + split * chunk
            else:
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
            if SOFTCAP > 0.0:  # s is in log2 units: c tanh(x / c) of the natural score x = s / log2(e)
                s = (SOFTCAP * LOG2E) * _tanh(s / (SOFTCAP * LOG2E))
            if WINDOW > 0:
                s = tl.where(n_ok[None, :] & (offs_n[None, :] <= qpos[:, None])
                             & (offs_n[None, :] > qpos[:, None] - WINDOW), s, float("-inf"))
            else:
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

        if HAS_SINKS and not SPLIT:  # the sink joins the denominator (split: the merge adds it once)
            sink = tl.load(SINKS + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            m_f = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_f)
            l_i = l_i * alpha + tl.exp2(sink - m_f)
            acc = acc * alpha[:, None]
            acc_hi = acc_hi * alpha[:, None]
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
