"""moe_experts_biased for few tokens (decode): moe_decode.py's sort-free scheme with the biases and the activation.

Each program owns one expert and one N-tile of its weights, finds the pairs naming its expert itself
(``_owned_expert`` / ``_chunk_pairs`` of moe_decode.py, so the grid is a function of T, k and E only and the
path is CUDA-graph capturable), streams its weight tile once, and:

1. ``_gate_up_act_kernel``: act[pair] = act(x[t] @ w13[e].T + b13[e]) (``ACT`` 0: silu(gate) * up, 1: GPT-OSS's
   clamped SwiGLU), [T*k, I];
2. ``_down_bias_kernel``: pair_out[pair] = weight[pair] * (act[pair] @ w2[e].T + b2[e]), fp32 [T*k, H];
3. moe_decode.py's ``_sum_slots_kernel``: out[t] = the sum over its valid slots, in a fixed order.

Kernels of their own (not constexprs on moe_decode.py's), so the tuned SwiGLU decode kernels are untouched. The
one-token down kernel (moe_one_token.py) has no bias: at one token the per-slot down kernel and the slot sum
serve, as they do for ``moe_experts.kernel=decode``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_args, pdl_wait
from turnout.ops.triton._tuning import interpreted
from turnout.ops.triton.moe_decode import _chunk_pairs, _fit, _owned_expert, _pow2, _sum_slots_kernel
from turnout.ops.triton.moe_decode_config import DEFAULT_CONFIG, DecodeConfig

_INTERPRET = interpreted()


@triton.jit
def _gate_up_act_kernel(x_ptr, w13_ptr, b13_ptr, act_ptr, ids_ptr,
                        num_pairs, top_k, num_experts, H, I, alpha, limit,
                        stride_xt, stride_we, stride_wn, stride_be, stride_act,
                        SCAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BY_SLOT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
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
        if HAS_BIAS:
            b_base = b13_ptr + expert * stride_be
            acc_gate += tl.load(b_base + cols).to(tl.float32)[None, :]
            acc_up += tl.load(b_base + I + cols).to(tl.float32)[None, :]
        if ACT == 0:
            act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        else:  # clamped SwiGLU: gate clamped above, up both ways, (up + 1) * gate * sigmoid(alpha * gate)
            gate = tl.minimum(acc_gate, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        tl.store(act_ptr + pairs.to(tl.int64)[:, None] * stride_act + cols[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_bias_kernel(act_ptr, w2_ptr, b2_ptr, weights_ptr, out_ptr, ids_ptr,
                      num_pairs, num_experts, H, I,
                      stride_act, stride_we, stride_wn, stride_be, stride_out,
                      SCAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BY_SLOT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
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
        if HAS_BIAS:
            acc += tl.load(b2_ptr + expert * stride_be + cols).to(tl.float32)[None, :]
        weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)  # [BM] fp32
        tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :], acc * weight[:, None],
                 mask=row_ok[:, None] & col_ok[None, :])


def moe_experts_biased_decode(hidden: torch.Tensor, w13: torch.Tensor, w13_bias: torch.Tensor | None,
                              w2: torch.Tensor, w2_bias: torch.Tensor | None, topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor, act: int, alpha: float, limit: float,
                              config: DecodeConfig | None = None) -> torch.Tensor:
    """moe_experts_biased (turnout/ops/reference/moe_biased.py) for few pairs; correct for any T, fast for small.
    ``act``: 0 silu, 1 clamped SwiGLU."""
    cfg = config or DEFAULT_CONFIG
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    has_b13, has_b2 = w13_bias is not None, w2_bias is not None
    b13 = w13_bias.contiguous() if has_b13 else w13  # any pointer when absent: never read (HAS_BIAS=False)
    b2 = w2_bias.contiguous() if has_b2 else w2
    ids = topk_ids.contiguous()  # any integer dtype: no narrowing that could turn an invalid id valid
    weights = topk_weights.float().contiguous()

    by_slot = num_pairs < num_experts
    grid0 = num_pairs if by_slot else num_experts
    scan = max(16, min(128, _pow2(num_pairs)))
    precision = "ieee" if hidden.dtype == torch.float32 else None  # fp32 must not become tf32
    upcast = _INTERPRET and hidden.dtype == torch.bfloat16  # the interpreter's bf16 dot is unreliable
    stages = 1 if _INTERPRET else cfg.num_stages if by_slot else cfg.num_stages_many
    bn1, bk1 = _fit(cfg.block_n1, inter), _fit(cfg.block_k1, hidden_size)
    bn2, bk2 = (cfg.block_n2, cfg.block_k2) if by_slot else (cfg.block_n2_many, cfg.block_k2_many)
    bn2, bk2 = _fit(bn2, hidden_size), _fit(bk2, inter)

    act_out = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)  # [T*k, I]
    _gate_up_act_kernel[(grid0, triton.cdiv(inter, bn1))](
        hidden, w13, b13, act_out, ids, num_pairs, top_k, num_experts, hidden_size, inter, float(alpha),
        float(limit), hidden.stride(0), w13.stride(0), w13.stride(1), b13.stride(0) if has_b13 else 0,
        act_out.stride(0), SCAN=scan, BLOCK_M=cfg.block_m, BLOCK_N=bn1, BLOCK_K=bk1, BY_SLOT=by_slot,
        EVEN_K=hidden_size % bk1 == 0, HAS_BIAS=has_b13, ACT=act, PRECISION=precision, UPCAST=upcast,
        num_warps=cfg.num_warps, num_stages=stages, **pdl_args(hidden))
    pair_out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)  # [T*k, H]
    _down_bias_kernel[(grid0, triton.cdiv(hidden_size, bn2))](
        act_out, w2, b2, weights, pair_out, ids, num_pairs, num_experts, hidden_size, inter,
        act_out.stride(0), w2.stride(0), w2.stride(1), b2.stride(0) if has_b2 else 0, pair_out.stride(0),
        SCAN=scan, BLOCK_M=cfg.block_m, BLOCK_N=bn2, BLOCK_K=bk2, BY_SLOT=by_slot, EVEN_K=inter % bk2 == 0,
        HAS_BIAS=has_b2, PRECISION=precision, UPCAST=upcast,
        num_warps=cfg.num_warps2 or cfg.num_warps, num_stages=1 if _INTERPRET else cfg.num_stages2 or stages,
        **pdl_args(hidden))
    out = torch.empty_like(hidden)  # [T, H]
    kp = _pow2(top_k)
    block_h = max(16, min(_pow2(hidden_size), 4096 // kp))  # a [KP, BLOCK_H] fp32 tile of <= 16 KB
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        pair_out, ids, out, top_k, num_experts, hidden_size, pair_out.stride(0), out.stride(0),
        KP=kp, BLOCK_H=block_h, num_warps=4, **pdl_args(hidden))
    return out
