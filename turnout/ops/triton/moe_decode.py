"""moe_experts for few tokens (decode): no sort, no padding, each active expert's weights streamed once.

At decode the (token, slot) pairs are few (T * k of them) and most experts get one or two tokens, so the
sort-and-align preamble of the grouped GEMM (a dozen torch ops) and its BLOCK_M padding cost more than the
GEMMs. Here every program finds its own rows:

* a program owns one expert and one N-tile of its weights. The grid is ``(min(E, T*k), N tiles)``:
  ``BY_SLOT`` (T*k < E): program s takes the expert of flat slot s if s is the first slot naming that
  expert (duplicates and ids outside [0, E) exit at once); otherwise program e takes expert e. Either way
  the grid is a function of T, k and E only (CUDA-graph capturable, no host sync).
* it scans the T*k ids (a few hundred bytes, from L2) SCAN at a time, ranks the pairs naming its expert
  with a cumsum and gathers them BLOCK_M at a time (one chunk at decode), then streams its weight tile
  with pipelined 16-byte loads (cp.async); tl.dot with M = BLOCK_M (16) costs nothing next to the reads.

1. ``_decode_gate_up_kernel``: act[pair] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)  [T*k, I]
2. ``_decode_down_kernel``: pair_out[pair] = weight[pair] * act[pair] @ w2[e].T  fp32 [T*k, H]
3. ``_sum_slots_kernel``: out[t] = sum_j pair_out[t, j] over the slots with a valid id (deterministic,
   no atomics; rows of invalid ids are never written nor read), cast to hidden's dtype. All slots of a
   column tile come in one 2-D load: at batch 1 the kernel is one memory round trip.

For one token (batch-1 decode) steps 2 and 3 are one kernel (turnout/ops/triton/moe_one_token.py): a program owns a
column tile of H and streams that tile of every slot's expert (the k experts' rows, one after another in one
pipelined loop), with the slot weight folded into the activation, so the slots are summed in registers and
the layer needs no third kernel nor the fp32 round trip of the per-slot outputs.

The routing is consumed as given: the router's ids and weights already hold its per-expert scale and bias
(turnout/layers/moe/router.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_args, pdl_wait
from turnout.ops.triton._tuning import interpreted
from turnout.ops.triton.moe_decode_config import DEFAULT_CONFIG, DecodeConfig
from turnout.ops.triton.moe_one_token import one_token_down_kernel

_INTERPRET = interpreted()

@triton.jit
def _owned_expert(ids_ptr, num_pairs, num_experts, SCAN: tl.constexpr, BY_SLOT: tl.constexpr):
    """(the expert this program owns, how many pairs name it); count 0: nothing to do, exit."""
    pid = tl.program_id(0)
    if BY_SLOT:
        expert = tl.load(ids_ptr + pid).to(tl.int64)
    else:
        expert = pid.to(tl.int64)
    count = tl.full([], 0, tl.int32)
    first = tl.full([], 0, tl.int32) + num_pairs
    for p0 in range(0, num_pairs, SCAN):  # the ids in SCAN-wide pieces: few registers for any T
        offs = p0 + tl.arange(0, SCAN)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int64)
        match = (ids == expert) & (offs < num_pairs)
        count += tl.sum(match.to(tl.int32), axis=0)
        first = tl.minimum(first, tl.min(tl.where(match, offs, num_pairs), axis=0))
    if BY_SLOT:  # the first slot naming a held expert owns it; the others exit
        owns = (first == pid) & (expert >= 0) & (expert < num_experts)
        count = tl.where(owns, count, 0)
    return expert, count


@triton.jit
def _chunk_pairs(ids_ptr, expert, num_pairs, c0, count, SCAN: tl.constexpr, BLOCK_M: tl.constexpr):
    """The pair indices of this expert's matches c0 .. c0 + BLOCK_M - 1 (0 past the count), in pair
    order, and which of the BLOCK_M rows are real."""
    m = c0 + tl.arange(0, BLOCK_M)
    pairs = tl.zeros((BLOCK_M,), dtype=tl.int32)
    seen = tl.full([], 0, tl.int32)
    for p0 in range(0, num_pairs, SCAN):
        offs = p0 + tl.arange(0, SCAN)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int64)
        match = (ids == expert) & (offs < num_pairs)
        rank = seen + tl.cumsum(match.to(tl.int32), axis=0) - 1  # [SCAN]: index among all matches
        sel = match[None, :] & (rank[None, :] == m[:, None])  # [BM, SCAN]: at most one hit per row
        pairs += tl.sum(tl.where(sel, offs[None, :], 0), axis=1)
        seen += tl.sum(match.to(tl.int32), axis=0)
    return pairs, m < count


@triton.jit
def _decode_gate_up_kernel(x_ptr, w13_ptr, act_ptr, ids_ptr,
                           num_pairs, top_k, num_experts, H, I,
                           stride_xt, stride_we, stride_wn, stride_act,
                           SCAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, BY_SLOT: tl.constexpr, EVEN_K: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    expert, count = _owned_expert(ids_ptr, num_pairs, num_experts, SCAN, BY_SLOT)
    if count == 0:
        return
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    cols = tl.where(col_ok, cols, 0)  # in-bounds addresses: the weight loads need no column mask
    w_gate = w13_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + I * stride_wn
    for c0 in range(0, count, BLOCK_M):
        pairs, row_ok = _chunk_pairs(ids_ptr, expert, num_pairs, c0, count, SCAN, BLOCK_M)
        x_rows = x_ptr + (pairs // top_k).to(tl.int64)[:, None] * stride_xt
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0)  # [BM, BK]
                wg = tl.load(w_gate + ks[:, None])  # [BK, BN]
                wu = tl.load(w_up + ks[:, None])
            else:
                k_ok = ks < H
                a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(w_gate + ks[:, None], mask=k_ok[:, None], other=0.0)
                wu = tl.load(w_up + ks[:, None], mask=k_ok[:, None], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_gate += tl.dot(a, wg, input_precision=PRECISION)
            acc_up += tl.dot(a, wu, input_precision=PRECISION)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(act_ptr + pairs.to(tl.int64)[:, None] * stride_act + cols[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _decode_down_kernel(act_ptr, w2_ptr, weights_ptr, out_ptr, ids_ptr,
                        num_pairs, num_experts, H, I,
                        stride_act, stride_we, stride_wn, stride_out,
                        SCAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, BY_SLOT: tl.constexpr, EVEN_K: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    expert, count = _owned_expert(ids_ptr, num_pairs, num_experts, SCAN, BY_SLOT)
    if count == 0:
        return
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    cols = tl.where(col_ok, cols, 0)
    w_rows = w2_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    for c0 in range(0, count, BLOCK_M):
        pairs, row_ok = _chunk_pairs(ids_ptr, expert, num_pairs, c0, count, SCAN, BLOCK_M)
        a_rows = act_ptr + pairs.to(tl.int64)[:, None] * stride_act
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None], other=0.0)  # [BM, BK]
                w = tl.load(w_rows + ks[:, None])  # [BK, BN]
            else:
                k_ok = ks < I
                a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(a, w, input_precision=PRECISION)
        weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)  # [BM] fp32
        tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :], acc * weight[:, None],
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_slots_kernel(pair_out_ptr, ids_ptr, out_ptr, top_k, num_experts, H, stride_pair, stride_out,
                      KP: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """All k slots of a column tile in one [KP, BLOCK_H] load (one memory round trip, not k), summed over
    axis 0 in the compiled reduction's fixed order (the same result on every run)."""
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    slots = tl.arange(0, KP)
    pairs = t * top_k + slots
    e = tl.load(ids_ptr + pairs, mask=slots < top_k, other=-1).to(tl.int64)  # [KP]
    ok = (slots < top_k) & (e >= 0) & (e < num_experts)
    vals = tl.load(pair_out_ptr + pairs.to(tl.int64)[:, None] * stride_pair + cols[None, :],
                   mask=ok[:, None] & col_ok[None, :], other=0.0)  # [KP, BH] fp32
    tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, tl.sum(vals, axis=0).to(out_ptr.dtype.element_ty),
             mask=col_ok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fit(block: int, n: int) -> int:
    """A tile no wider than needed (toy shapes), never below 16 (tl.dot)."""
    return max(16, min(block, _pow2(n)))


def moe_experts_decode(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, config: DecodeConfig | None = None) -> torch.Tensor:
    """moe_experts (see turnout/ops/reference/moe.py) for few pairs; correct for any T, fast for small."""
    cfg = config or DEFAULT_CONFIG
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    hidden = hidden.contiguous()
    w13 = w13.contiguous()
    w2 = w2.contiguous()
    ids = topk_ids.contiguous()  # any integer dtype: no narrowing that could turn an invalid id valid
    weights = topk_weights.contiguous()
    if weights.dtype != torch.float32:
        weights = weights.float()

    by_slot = num_pairs < num_experts
    grid0 = num_pairs if by_slot else num_experts
    scan = max(16, min(128, _pow2(num_pairs)))
    precision = "ieee" if hidden.dtype == torch.float32 else None  # fp32 must not become tf32
    upcast = _INTERPRET and hidden.dtype == torch.bfloat16  # the interpreter's bf16 dot is unreliable
    stages = 1 if _INTERPRET else cfg.num_stages if by_slot else cfg.num_stages_many
    bn1, bk1 = _fit(cfg.block_n1, inter), _fit(cfg.block_k1, hidden_size)
    bn2, bk2 = (cfg.block_n2, cfg.block_k2) if by_slot else (cfg.block_n2_many, cfg.block_k2_many)
    bn2, bk2 = _fit(bn2, hidden_size), _fit(bk2, inter)

    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)  # [T*k, I]
    _decode_gate_up_kernel[(grid0, triton.cdiv(inter, bn1))](
        hidden, w13, act, ids, num_pairs, top_k, num_experts, hidden_size, inter,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        SCAN=scan, BLOCK_M=cfg.block_m, BLOCK_N=bn1, BLOCK_K=bk1, BY_SLOT=by_slot,
        EVEN_K=hidden_size % bk1 == 0, PRECISION=precision, UPCAST=upcast,
        num_warps=cfg.num_warps, num_stages=stages, **pdl_args(hidden, "moe_gate_up"))
    out = torch.empty_like(hidden)  # [T, H]
    kp = _pow2(top_k)
    if num_tokens == 1 and cfg.one_token:
        bn, bk = max(1, min(cfg.block_n_one, _pow2(hidden_size))), max(16, min(cfg.block_k_one, _pow2(inter)))
        one_token_down_kernel[(triton.cdiv(hidden_size, bn),)](
            act, w2, weights, out, ids, top_k, num_experts, hidden_size, inter,
            act.stride(0), w2.stride(0), w2.stride(1),
            KP=kp, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=inter % bk == 0,
            num_warps=cfg.num_warps_one, num_stages=1 if _INTERPRET else cfg.num_stages_one,
            **pdl_args(hidden, "moe_down"))
        return out
    pair_out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)  # [T*k, H]
    _decode_down_kernel[(grid0, triton.cdiv(hidden_size, bn2))](
        act, w2, weights, pair_out, ids, num_pairs, num_experts, hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        SCAN=scan, BLOCK_M=cfg.block_m, BLOCK_N=bn2, BLOCK_K=bk2, BY_SLOT=by_slot,
        EVEN_K=inter % bk2 == 0, PRECISION=precision, UPCAST=upcast,
        num_warps=cfg.num_warps2 or cfg.num_warps, num_stages=1 if _INTERPRET else cfg.num_stages2 or stages,
        **pdl_args(hidden))
    block_h = max(16, min(_pow2(hidden_size), 4096 // kp))  # a [KP, BLOCK_H] fp32 tile of <= 16 KB
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        pair_out, ids, out, top_k, num_experts, hidden_size, pair_out.stride(0), out.stride(0),
        KP=kp, BLOCK_H=block_h, num_warps=4, **pdl_args(hidden))
    return out
