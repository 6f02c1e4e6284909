"""moe_experts in Triton: tokens sorted per expert into block-aligned rows, two grouped GEMMs.

1. ``align_block_size`` (torch ops on the device, no host sync, shapes a function of T only, so the
   whole op can be captured in a CUDA graph): every (token, slot) pair is placed in the rows of its
   expert; each expert's rows are padded to a multiple of BLOCK_M, so that one program's rows all belong
   to one expert.
2. ``_gate_up_silu_kernel``: per block, act = silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T), the activation
   fused into the epilogue (two accumulators, one pass over H).
3. ``_down_weighted_kernel``: per block, y = act @ w2[e].T times the pair's routing weight, written to the
   pair's own row (no atomics: the result is deterministic).
4. out = sum over the k slots of each token, in float32.

Few tokens (decode: T * k within a few pairs per expert, decided from host ints) take
``moe_decode.moe_experts_decode`` instead: no sort, each active expert's weights streamed once (and at
one token its down kernel sums the slots itself, moe_one_token.py). Which of the three runs is the
implementation's declared choice ``kernel`` (turnout/ops/triton/__init__.py:CHOICES): ``turnout ops``
shows it and ``TURNOUT_OPS="moe_experts.kernel=grouped"`` (or ``decode``) fixes it; ``auto`` is the
measured default below.

The routing is consumed as given: this file never looks at scores or recomputes top-k:
the router's ids and weights already hold its per-expert scale and bias (turnout/layers/moe/router.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from turnout.ops.triton._tuning import interpreted
from turnout.ops.triton.moe_decode import moe_experts_decode
from turnout.ops.triton.moe_decode_config import DEFAULT_CONFIG, DecodeConfig, use_decode

_INTERPRET = interpreted()


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort (token, slot) pairs by expert into BLOCK_M-aligned rows.

    Returns ``sorted_pairs`` int32 [R] (pair index t * k + j, or N = T * k for padding rows) and
    ``block_expert`` int32 [R / BLOCK_M] (the expert of each block of rows, -1 for blocks past the end).
    R = N + min(E, N) * (BLOCK_M - 1) rounded up to BLOCK_M is an upper bound of the padded rows that
    depends on the shapes only. Ids outside [0, E) are not placed (experts of another rank).
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [N]
    num_pairs = flat.numel()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # invalid -> bucket E, sorted last
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # [E + 1]
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    # Row where each expert's segment starts; bucket E (invalid ids) goes past `rows`, then sliced off.
    seg_start = torch.cat([padded_end - padded, torch.full((1,), rows, dtype=torch.long, device=device)])
    order = torch.argsort(key, stable=True)  # [N] pair indices grouped by expert, token order within
    key_sorted = key[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[key_sorted]
    sorted_pairs = torch.full((rows + num_pairs,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, seg_start[key_sorted] + rank, order.to(torch.int32))  # distinct destinations
    block_start = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # first e with end > start
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs[:rows], block_expert


@triton.jit
def _gate_up_silu_kernel(x_ptr, w13_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr,
                         num_pairs, top_k, H, I,
                         stride_xt, stride_we, stride_wn, stride_act,
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
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_act + cols[None, :],
             act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_weighted_kernel(act_ptr, w2_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr,
                          num_pairs, H, I,
                          stride_act, stride_we, stride_wn, stride_out,
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
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)  # [BM] fp32
    acc = acc * weight[:, None]
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n1: int  # gate/up: columns of I per program (two accumulators, gate and up)
    block_k1: int
    block_n2: int  # down: columns of H per program
    block_k2: int
    num_warps: int
    num_stages: int


def gemm_config(num_pairs: int, num_experts: int) -> GemmConfig:
    """Tiles from the mean pairs per expert (host ints). Few rows per expert: BLOCK_M 16 and tiles that
    stream the weights (wide K, deep pipeline); many: big tiles that reuse them (Hopper-sized)."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return GemmConfig(16, 32, 128, 64, 128, num_warps=4, num_stages=4)
    if per_expert <= 48:
        return GemmConfig(32, 64, 128, 128, 128, num_warps=4, num_stages=3)
    if per_expert <= 96:
        return GemmConfig(64, 64, 64, 128, 64, num_warps=4, num_stages=4)
    return GemmConfig(128, 64, 64, 128, 64, num_warps=8, num_stages=4)


def _tile(n: int, cap: int) -> int:
    return max(16, min(cap, _next_pow2(n)))


def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, kernel: str = "auto",
                decode_config: DecodeConfig | None = None) -> torch.Tensor:
    """See turnout/ops/reference/moe.py for the contract. ``kernel`` (the policy's ``moe_experts.kernel``,
    bound once by the op table): "auto", "grouped" or "decode". ``decode_config``: the decode kernels' tiles
    (TURNOUT_MOE_DECODE_CONFIG), bound once by the op table; None: the measured ones."""
    num_tokens, hidden_size = hidden.shape
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    if kernel == "auto":  # the measured default
        if use_decode(num_tokens, top_k, num_experts):
            return moe_experts_decode(hidden, w13, w2, topk_weights, topk_ids, config=decode_config)
        return moe_experts_grouped(hidden, w13, w2, topk_weights, topk_ids)
    if kernel == "grouped":
        return moe_experts_grouped(hidden, w13, w2, topk_weights, topk_ids)
    if kernel == "decode":  # the decode kernels at every T, per-slot down kernel and slot sum
        config = replace(decode_config or DEFAULT_CONFIG, one_token=0)
        return moe_experts_decode(hidden, w13, w2, topk_weights, topk_ids, config=config)
    raise ValueError(f"moe_experts: kernel must be auto, grouped or decode, got {kernel!r}")


def moe_experts_grouped(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """The sorted, block-aligned grouped-GEMM path (any T; the one used beyond decode sizes)."""
    num_tokens, hidden_size = hidden.shape
    if num_tokens * topk_ids.shape[1] == 0:
        return torch.zeros_like(hidden)
    return grouped_pair_outputs(hidden, w13, w2, topk_weights, topk_ids, config).sum(dim=1).to(hidden.dtype)


def grouped_pair_outputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """Steps 1-3: each (token, slot) pair's weighted expert output, float32 [T, k, H] (the batch-invariant
    mode sums the slots itself, in a fixed order: turnout/ops/triton/batch_invariant.py)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    hidden = hidden.contiguous()
    w13 = w13.contiguous()
    w2 = w2.contiguous()
    weights = topk_weights.float().contiguous().reshape(-1)  # [N]

    cfg = config or gemm_config(num_pairs, num_experts)
    block_m = cfg.block_m
    sorted_pairs, block_expert = align_block_size(topk_ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    # fp32 must not silently become tf32; the interpreter's dot is unreliable below fp32.
    precision = "ieee" if hidden.dtype == torch.float32 else None  # None: the target's default
    upcast = _INTERPRET and hidden.dtype == torch.bfloat16
    num_warps, num_stages = cfg.num_warps, (1 if _INTERPRET else cfg.num_stages)

    act = torch.empty(sorted_pairs.numel(), inter, dtype=hidden.dtype, device=hidden.device)  # [R, I]
    bn1, bk1 = _tile(inter, cfg.block_n1), _tile(hidden_size, cfg.block_k1)
    _gate_up_silu_kernel[(num_blocks, triton.cdiv(inter, bn1))](
        hidden, w13, act, sorted_pairs, block_expert, num_pairs, top_k, hidden_size, inter,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn1, BLOCK_K=bk1, PRECISION=precision, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages)

    # Rows of pairs whose expert is not held here are never written: zeros.
    pair_out = torch.zeros(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)  # [N, H]
    bn2, bk2 = _tile(hidden_size, cfg.block_n2), _tile(inter, cfg.block_k2)
    _down_weighted_kernel[(num_blocks, triton.cdiv(hidden_size, bn2))](
        act, w2, pair_out, weights, sorted_pairs, block_expert, num_pairs, hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=bk2, PRECISION=precision, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages)
    return pair_out.view(num_tokens, top_k, hidden_size)
