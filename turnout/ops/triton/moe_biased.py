"""moe_experts_biased in Triton: the grouped path of moe.py with the biases and the activation in the epilogues.

The (token, slot) pairs are sorted per expert into block-aligned rows exactly as for ``moe_experts``
(``align_block_size``, tiles from ``gemm_config``), then:

1. ``_gate_up_act_kernel``: per block, gate = x @ w13[e, :I].T + b13[e, :I], up likewise, and the activation
   (``ACT``: 0 silu(gate) * up, 1 GPT-OSS's clamped SwiGLU) on the float32 accumulators;
2. ``_down_bias_weighted_kernel``: per block, y = act @ w2[e].T + b2[e], times the pair's routing weight, written
   to the pair's own row (deterministic, no atomics);
3. out = the sum over the k slots of each token, in float32.

Kernels of their own rather than constexprs on moe.py's, so the tuned SwiGLU kernels stay exactly as they
were. Few pairs (decode, ``use_decode`` as for ``moe_experts``) take the sort-free kernels of
moe_biased_decode.py instead; there is no one-token variant (its down kernel has no bias). The declared choice
``kernel`` (turnout/ops/triton/__init__.py) fixes either path: ``grouped`` or ``decode``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.reference.moe_biased import check_activation
from turnout.ops.triton._tuning import interpreted
from turnout.ops.triton.moe import _tile, align_block_size, gemm_config
from turnout.ops.triton.moe_biased_decode import moe_experts_biased_decode
from turnout.ops.triton.moe_decode_config import DecodeConfig, use_decode

_INTERPRET = interpreted()
_ACT = {"silu": 0, "clamped_swiglu": 1}


@triton.jit
def _gate_up_act_kernel(x_ptr, w13_ptr, b13_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr,
                        num_pairs, top_k, H, I, alpha, limit,
                        stride_xt, stride_we, stride_wn, stride_be, stride_act,
                        HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    w_base = w13_ptr + expert * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        wu = tl.load(w_base + (cols[None, :] + I) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_gate += tl.dot(a, wg, input_precision=PRECISION)
        acc_up += tl.dot(a, wu, input_precision=PRECISION)
    if HAS_BIAS:
        b_base = b13_ptr + expert * stride_be
        acc_gate += tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_base + I + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACT == 0:
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    else:  # clamped SwiGLU: gate clamped above, up both ways, (up + 1) * gate * sigmoid(alpha * gate)
        gate = tl.minimum(acc_gate, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_act + cols[None, :],
             act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_bias_weighted_kernel(act_ptr, w2_ptr, b2_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr,
                               num_pairs, H, I,
                               stride_act, stride_we, stride_wn, stride_be, stride_out,
                               HAS_BIAS: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    w_base = w2_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < I
        a = tl.load(act_ptr + rows[:, None].to(tl.int64) * stride_act + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)  # [BK, BN]
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b2_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)  # [BM] fp32
    acc = acc * weight[:, None]
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


def moe_experts_biased(hidden: torch.Tensor, w13: torch.Tensor, w13_bias: torch.Tensor | None, w2: torch.Tensor,
                       w2_bias: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       activation: str = "clamped_swiglu", alpha: float = 1.702, limit: float = 7.0, *,
                       kernel: str = "auto", decode_config: DecodeConfig | None = None) -> torch.Tensor:
    """See turnout/ops/reference/moe_biased.py for the contract. ``kernel`` (the policy's
    ``moe_experts_biased.kernel``, bound once by the op table): "auto", "grouped" or "decode". ``decode_config``:
    the decode kernels' tiles (TURNOUT_MOE_DECODE_CONFIG, bound once by the op table)."""
    check_activation(activation)
    if kernel not in ("auto", "grouped", "decode"):
        raise ValueError(f"moe_experts_biased: kernel must be auto, grouped or decode, got {kernel!r}")
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    if kernel == "decode" or (kernel == "auto" and use_decode(num_tokens, top_k, num_experts)):
        return moe_experts_biased_decode(hidden, w13, w13_bias, w2, w2_bias, topk_weights, topk_ids,
                                         _ACT[activation], alpha, limit, config=decode_config)
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    has_b13, has_b2 = w13_bias is not None, w2_bias is not None
    b13 = w13_bias.contiguous() if has_b13 else w13  # any pointer when absent: never read (HAS_BIAS=False)
    b2 = w2_bias.contiguous() if has_b2 else w2
    weights = topk_weights.float().contiguous().reshape(-1)  # [N]

    cfg = gemm_config(num_pairs, num_experts)
    block_m = cfg.block_m
    sorted_pairs, block_expert = align_block_size(topk_ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    precision = "ieee" if hidden.dtype == torch.float32 else None  # fp32 must not silently become tf32
    upcast = _INTERPRET and hidden.dtype == torch.bfloat16  # the interpreter's bf16 dot is wrong
    num_warps, num_stages = cfg.num_warps, (1 if _INTERPRET else cfg.num_stages)

    act = torch.empty(sorted_pairs.numel(), inter, dtype=hidden.dtype, device=hidden.device)  # [R, I]
    bn1, bk1 = _tile(inter, cfg.block_n1), _tile(hidden_size, cfg.block_k1)
    _gate_up_act_kernel[(num_blocks, triton.cdiv(inter, bn1))](
        hidden, w13, b13, act, sorted_pairs, block_expert, num_pairs, top_k, hidden_size, inter,
        float(alpha), float(limit), hidden.stride(0), w13.stride(0), w13.stride(1),
        b13.stride(0) if has_b13 else 0, act.stride(0),
        HAS_BIAS=has_b13, ACT=_ACT[activation], BLOCK_M=block_m, BLOCK_N=bn1, BLOCK_K=bk1, PRECISION=precision,
        UPCAST=upcast, num_warps=num_warps, num_stages=num_stages)

    pair_out = torch.zeros(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)  # [N, H]
    bn2, bk2 = _tile(hidden_size, cfg.block_n2), _tile(inter, cfg.block_k2)
    _down_bias_weighted_kernel[(num_blocks, triton.cdiv(hidden_size, bn2))](
        act, w2, b2, pair_out, weights, sorted_pairs, block_expert, num_pairs, hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), b2.stride(0) if has_b2 else 0, pair_out.stride(0),
        HAS_BIAS=has_b2, BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=bk2, PRECISION=precision, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages)
    # rows of pairs whose expert another rank holds were never written: zeros
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
