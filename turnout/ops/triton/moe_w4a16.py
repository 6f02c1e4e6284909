"""moe_experts_w4a16 in Triton (layout: turnout/ops/reference/moe_w4a16.py): the float ``moe_experts`` grouped path
(turnout/ops/triton/moe.py) with 4-bit weight tiles.

1. ``align_block_size`` (moe.py): the (token, slot) pairs sorted by expert into BLOCK_M-aligned rows, so one
   program's rows all belong to one expert (no host sync; shapes a function of T only).
2. ``_gate_up_kernel``: a program per row block and 64-row block b of the expert's gate (its up is block I/64 + b):
   each [BLOCK_K, 32] byte tile of the two blocks (low nibbles: rows 64b + j, high: 64b + 32 + j) is dequantised in
   registers, ``(q - 8) s + z`` with the group's scale and zero, to x's dtype and multiplied on the matrix units
   (four [BLOCK_M, 32] accumulators); the epilogue writes silu(gate) * up for its 64 columns of I.
3. ``_down_kernel``: a program per row block and 64-row block of H, K = I, times the pair's routing weight, into the
   pair's own row (no atomics: deterministic); 4. the slots of each token summed in float32.

Activation order reads the input of each expert through its ``perm`` row (gate/up: hidden columns; down: the
activation's), so no weight is permuted at run time. Under TRITON_INTERPRET=1 bfloat16 tiles are upcast (the
interpreter's bfloat16 ``tl.dot`` is wrong). One path at every T: a weight-streaming decode variant (as the float
op's moe_decode.py) is not written yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.triton._tuning import interpreted
from turnout.ops.triton.moe import align_block_size, gemm_config
from turnout.ops.w4_layout import ROWS, check_experts

_INTERPRET = interpreted()


@triton.jit
def _dequant(qw_ptr, sz_ptr, blk, k, k_ok, k0, N, j, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 [BLOCK_K, 32] low and high halves of 64-row block ``blk`` of one expert's weight at columns k."""
    t = tl.load(qw_ptr + k[:, None] * 32 + j[None, :], mask=k_ok[:, None], other=0).to(tl.int32)
    cols = (blk * 64 + j) * 2
    if GROUP >= BLOCK_K:  # the tile lies in one group: one scale and zero per column
        row = sz_ptr + (k0 // GROUP) * N * 2 + cols[None, :]
        s_lo = tl.load(row).to(tl.float32)
        z_lo = tl.load(row + 1).to(tl.float32)
        s_hi = tl.load(row + 64).to(tl.float32)
        z_hi = tl.load(row + 65).to(tl.float32)
    else:
        row = sz_ptr + (k // GROUP).to(tl.int64)[:, None] * N * 2 + cols[None, :]
        s_lo = tl.load(row, mask=k_ok[:, None], other=0.0).to(tl.float32)
        z_lo = tl.load(row + 1, mask=k_ok[:, None], other=0.0).to(tl.float32)
        s_hi = tl.load(row + 64, mask=k_ok[:, None], other=0.0).to(tl.float32)
        z_hi = tl.load(row + 65, mask=k_ok[:, None], other=0.0).to(tl.float32)
    return ((t & 15).to(tl.float32) - 8.0) * s_lo + z_lo, ((t >> 4).to(tl.float32) - 8.0) * s_hi + z_hi


@triton.jit
def _dot(a, w, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        return acc + tl.dot(a.to(tl.float32), w, input_precision="ieee")
    return acc + tl.dot(a, w.to(a.dtype), input_precision=PRECISION)


@triton.jit
def _gate_up_kernel(x_ptr, qw_ptr, sz_ptr, perm_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr,
                    num_pairs, top_k, H, I, stride_xt, stride_qe, stride_se, stride_act,
                    GROUP: tl.constexpr, HAS_PERM: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    blk = tl.program_id(1).to(tl.int64)  # 64-row block of the gate; the up's is I / 64 + blk
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs
    tokens = tl.where(row_ok, pairs // top_k, 0).to(tl.int64)
    j = tl.arange(0, 32)
    ks = tl.arange(0, BLOCK_K)
    up_blk = blk + I // 64
    qw = qw_ptr + expert * stride_qe
    sz = sz_ptr + expert * stride_se
    acc_g_lo = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
    acc_g_hi = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
    acc_u_lo = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
    acc_u_hi = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        k_ok = k < H
        if HAS_PERM:
            col = tl.load(perm_ptr + expert * H + k, mask=k_ok, other=0)
        else:
            col = k
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + col[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        g_lo, g_hi = _dequant(qw + blk * H * 32, sz, blk, k, k_ok, k0, 2 * I, j, GROUP, BLOCK_K)
        u_lo, u_hi = _dequant(qw + up_blk * H * 32, sz, up_blk, k, k_ok, k0, 2 * I, j, GROUP, BLOCK_K)
        acc_g_lo = _dot(a, g_lo, acc_g_lo, UPCAST, PRECISION)
        acc_g_hi = _dot(a, g_hi, acc_g_hi, UPCAST, PRECISION)
        acc_u_lo = _dot(a, u_lo, acc_u_lo, UPCAST, PRECISION)
        acc_u_hi = _dot(a, u_hi, acc_u_hi, UPCAST, PRECISION)
    act_lo = acc_g_lo * tl.sigmoid(acc_g_lo) * acc_u_lo
    act_hi = acc_g_hi * tl.sigmoid(acc_g_hi) * acc_u_hi
    out = act_ptr + rows[:, None].to(tl.int64) * stride_act + blk * 64 + j[None, :]
    tl.store(out, act_lo.to(act_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(out + 32, act_hi.to(act_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _down_kernel(act_ptr, qw_ptr, sz_ptr, perm_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr,
                 num_pairs, H, I, stride_act, stride_qe, stride_se, stride_out,
                 GROUP: tl.constexpr, HAS_PERM: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    blk = tl.program_id(1).to(tl.int64)  # 64-row block of H
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs
    j = tl.arange(0, 32)
    ks = tl.arange(0, BLOCK_K)
    qw = qw_ptr + expert * stride_qe + blk * I * 32
    sz = sz_ptr + expert * stride_se
    acc_lo = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + ks
        k_ok = k < I
        if HAS_PERM:
            col = tl.load(perm_ptr + expert * I + k, mask=k_ok, other=0)
        else:
            col = k
        a = tl.load(act_ptr + rows[:, None].to(tl.int64) * stride_act + col[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w_lo, w_hi = _dequant(qw, sz, blk, k, k_ok, k0, H, j, GROUP, BLOCK_K)
        acc_lo = _dot(a, w_lo, acc_lo, UPCAST, PRECISION)
        acc_hi = _dot(a, w_hi, acc_hi, UPCAST, PRECISION)
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]  # [BM, 1] fp32
    out = out_ptr + tl.where(row_ok, pairs, 0).to(tl.int64)[:, None] * stride_out + blk * 64 + j[None, :]
    tl.store(out, acc_lo * weight, mask=row_ok[:, None])
    tl.store(out + 32, acc_hi * weight, mask=row_ok[:, None])


def moe_experts_w4a16(hidden: torch.Tensor, w13_qweight: torch.Tensor, w13_scale_zeros: torch.Tensor,
                      w2_qweight: torch.Tensor, w2_scale_zeros: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, group_size: int, w13_perm: torch.Tensor | None = None,
                      w2_perm: torch.Tensor | None = None, *, block_m: int | None = None) -> torch.Tensor:
    """See turnout/ops/reference/moe_w4a16.py. ``block_m``: rows per program (None: the float grouped path's choice
    from the mean pairs per expert)."""
    if hidden.dim() != 2:
        raise ValueError(f"moe_experts_w4a16 takes hidden [T, H], got {tuple(hidden.shape)}")
    num_experts, inter = check_experts(hidden.shape[1], w13_qweight, w13_scale_zeros, w2_qweight, w2_scale_zeros,
                                       group_size, w13_perm, w2_perm)
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    hidden = hidden.contiguous()
    w13_qweight, w2_qweight = w13_qweight.contiguous(), w2_qweight.contiguous()
    w13_scale_zeros, w2_scale_zeros = w13_scale_zeros.contiguous(), w2_scale_zeros.contiguous()
    perm13 = w13_perm.contiguous() if w13_perm is not None else hidden
    perm2 = w2_perm.contiguous() if w2_perm is not None else hidden
    weights = topk_weights.float().contiguous().reshape(-1)  # [N]
    bm = block_m or gemm_config(num_pairs, num_experts).block_m
    sorted_pairs, block_expert = align_block_size(topk_ids, num_experts, bm)
    num_blocks = block_expert.numel()
    common = dict(GROUP=group_size, UPCAST=_INTERPRET and hidden.dtype == torch.bfloat16,
                  PRECISION="ieee" if hidden.dtype == torch.float32 else None, BLOCK_M=bm, BLOCK_K=64,
                  num_warps=4 if bm <= 64 else 8, num_stages=1 if _INTERPRET else 3)

    act = torch.empty(sorted_pairs.numel(), inter, dtype=hidden.dtype, device=hidden.device)  # [R, I]
    _gate_up_kernel[(num_blocks, inter // ROWS)](
        hidden, w13_qweight, w13_scale_zeros, perm13, act, sorted_pairs, block_expert, num_pairs, top_k,
        hidden_size, inter, hidden.stride(0), w13_qweight.stride(0), w13_scale_zeros.stride(0), act.stride(0),
        HAS_PERM=w13_perm is not None, **common)
    # rows of pairs whose expert is not held here are never written: zeros
    pair_out = torch.zeros(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)  # [N, H]
    _down_kernel[(num_blocks, hidden_size // ROWS)](
        act, w2_qweight, w2_scale_zeros, perm2, pair_out, weights, sorted_pairs, block_expert, num_pairs,
        hidden_size, inter, act.stride(0), w2_qweight.stride(0), w2_scale_zeros.stride(0), pair_out.stride(0),
        HAS_PERM=w2_perm is not None, **common)
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
