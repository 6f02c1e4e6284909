"""moe_experts_fp8 in Triton: the grouped GEMMs of turnout/ops/triton/moe.py on fp8 weights with 128 x 128 blocks.

The contract and layouts are in turnout/ops/reference/moe_fp8.py. The sorted path (larger batches, prefill):

1. ``align_block_size`` (moe.py, device-side, no host sync): (token, slot) pairs sorted per expert into
   BLOCK_M-aligned rows.
2. ``_gate_up_kernel``: per block of rows and 128 columns of I, K steps by 128 (one activation group and one
   weight block): the gathered hidden tile is quantised in registers (``quantize_tile``: quantize_fp8's arithmetic,
   so no quantisation kernel runs first), ``tl.dot`` of fp8 x fp8, and the tile's product is added into the float32
   gate and up accumulators times the rows' group scales and the block's scale (the promotion interval of
   ops/triton/fp8.py). The epilogue quantises silu(gate) * up per row (the program's 128 columns are one group)
   and writes fp8 activations and their scales.
3. ``_down_kernel``: fp8 activations x fp8 down per 128 K tile, times the activation scales (per row) and the
   block scales (per column), times the routing weight, into the pair's own float32 row (no atomics).
4. out = the sum over each token's k slots, in float32.

Few tokens take turnout/ops/triton/moe_fp8_decode.py (no sort). The choice is the implementation's ``kernel``
(``auto|grouped|decode``, as moe_experts': turnout/ops/triton/__init__.py CHOICES). Tiles are not swept on the
H200 yet: BLOCK_K is the scale group, 128; BLOCK_M from the mean pairs per expert as in moe.py's gemm_config.

The routing is consumed as given: nothing here looks at scores or recomputes top-k:
the router's ids and weights already hold its per-expert scale and bias (turnout/layers/moe/router.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.reference.fp8 import BLOCK, FP8, MIN_SCALE
from turnout.ops.reference.moe_fp8 import check_shapes
from turnout.ops.triton.fp8 import quantize_tile
from turnout.ops.triton.moe import align_block_size
from turnout.ops.triton.moe_decode_config import use_decode
from turnout.ops.triton.moe_fp8_decode import ROUND, moe_experts_fp8_decode


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ws_ptr, aq_ptr, as_ptr, sorted_pairs_ptr, block_expert_ptr,
                    num_pairs, top_k, H, I, NB_I,
                    stride_xt, stride_we, stride_wn, stride_wse, stride_wsn, stride_aq, stride_as,
                    BLOCK_M: tl.constexpr, MIN_S: tl.constexpr, ROUND_E4M3: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs
    x_rows = x_ptr + (pairs // top_k).to(tl.int64)[:, None] * stride_xt
    cols = pid_n * 128 + tl.arange(0, 128)
    col_ok = cols < I
    w_gate = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + I * stride_wn
    s_gate = ws_ptr + expert * stride_wse + pid_n * stride_wsn
    s_up = s_gate + NB_I * stride_wsn
    acc_gate = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
    for k0 in range(0, H, 128):
        ks = k0 + tl.arange(0, 128)
        k_ok = ks < H
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        q, s = quantize_tile(x, MIN_S, ROUND_E4M3)
        a = q.to(w_ptr.dtype.element_ty)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0)  # [128, 128] fp8
        wu = tl.load(w_up + ks[:, None], mask=w_mask, other=0.0)
        kb = k0 // 128
        acc_gate += tl.dot(a, wg) * (s * tl.load(s_gate + kb))[:, None]
        acc_up += tl.dot(a, wu) * (s * tl.load(s_up + kb))[:, None]
    act = tl.where(col_ok[None, :], acc_gate * tl.sigmoid(acc_gate) * acc_up, 0.0)
    q, s = quantize_tile(act, MIN_S, ROUND_E4M3)
    out_rows = rows.to(tl.int64)
    tl.store(aq_ptr + out_rows[:, None] * stride_aq + cols[None, :], q.to(aq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
    tl.store(as_ptr + out_rows * stride_as + pid_n, s, mask=row_ok)


@triton.jit
def _down_kernel(aq_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr,
                 num_pairs, H, I,
                 stride_aq, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
    cols_c = tl.where(col_ok, cols, 0)
    a_rows = aq_ptr + rows.to(tl.int64)[:, None] * stride_aq
    s_rows = as_ptr + rows.to(tl.int64) * stride_as
    w_rows = w_ptr + expert * stride_we + cols_c[None, :].to(tl.int64) * stride_wn
    ws_rows = ws_ptr + expert * stride_wse + (cols_c // 128) * stride_wsn  # [BN]: each column's block row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, 128):
        ks = k0 + tl.arange(0, 128)
        k_ok = ks < I
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, 128] fp8
        w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [128, BN] fp8
        kb = k0 // 128
        sa = tl.load(s_rows + kb, mask=row_ok, other=0.0)
        acc += tl.dot(a, w) * sa[:, None] * tl.load(ws_rows + kb)[None, :]
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)  # [BM] fp32
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :], acc * weight[:, None],
             mask=row_ok[:, None] & col_ok[None, :])


def gemm_config(num_pairs: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, down's BLOCK_N, num_warps, num_stages) from the mean pairs per expert (host ints): few rows per
    expert stream the weights, many reuse them (Hopper-sized tiles; fp8 tiles of 128 x 128 are 16 KB)."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return 16, 64, 4, 4
    if per_expert <= 48:
        return 32, 128, 4, 4
    if per_expert <= 96:
        return 64, 128, 4, 3
    return 128, 128, 8, 3


def moe_experts_fp8_grouped(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids,
                            config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The sorted, block-aligned grouped-GEMM path (any T; the one used beyond decode sizes); ``config``: the
    tiles instead of ``gemm_config``'s."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weights = topk_weights.float().contiguous().reshape(-1)  # [N]
    block_m, bn2, warps, stages = config or gemm_config(num_pairs, num_experts)
    stages = 1 if ROUND else stages
    sorted_pairs, block_expert = align_block_size(topk_ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    nb_i = triton.cdiv(inter, BLOCK)
    aq = torch.empty(sorted_pairs.numel(), inter, dtype=FP8, device=hidden.device)  # [R, I]
    a_s = torch.empty(sorted_pairs.numel(), nb_i, dtype=torch.float32, device=hidden.device)  # [R, ceil(I/128)]
    _gate_up_kernel[(num_blocks, nb_i)](
        hidden, w13, w13_scale, aq, a_s, sorted_pairs, block_expert, num_pairs, top_k, hidden_size, inter, nb_i,
        hidden.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), aq.stride(0),
        a_s.stride(0), BLOCK_M=block_m, MIN_S=MIN_SCALE, ROUND_E4M3=ROUND, num_warps=warps, num_stages=stages)
    # Rows of pairs whose expert is not held here are never written: zeros.
    pair_out = torch.zeros(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)  # [N, H]
    bn2 = max(16, min(bn2, triton.next_power_of_2(hidden_size)))
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, bn2))](
        aq, a_s, w2, w2_scale, pair_out, weights, sorted_pairs, block_expert, num_pairs, hidden_size, inter,
        aq.stride(0), a_s.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        pair_out.stride(0), BLOCK_M=block_m, BLOCK_N=bn2, num_warps=warps, num_stages=stages)
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def moe_experts_fp8(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                    w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    kernel: str = "auto") -> torch.Tensor:
    """See turnout/ops/reference/moe_fp8.py. ``kernel`` (the policy's ``moe_experts_fp8.kernel``, bound once by the
    op table): "auto" (the one-token kernel at T = 1, the decode kernels while T*k <= max(128, 4E), the grouped
    GEMM beyond: moe_experts' thresholds), "grouped" or "decode" (per-slot down and the slot sum at every T)."""
    check_shapes(hidden, w13, w13_scale, w2, w2_scale)
    if w13.dtype != FP8 or w2.dtype != FP8:
        raise ValueError(f"moe_experts_fp8 takes float8_e4m3fn weights, got {w13.dtype} / {w2.dtype}")
    num_tokens = hidden.shape[0]
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    if num_tokens * top_k == 0:
        return torch.zeros_like(hidden)
    w13, w13_scale, w2, w2_scale = (_contiguous(t) for t in (w13, w13_scale.float(), w2, w2_scale.float()))
    args = (hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    if kernel == "auto":
        if use_decode(num_tokens, top_k, num_experts):
            return moe_experts_fp8_decode(*args)
        return moe_experts_fp8_grouped(*args)
    if kernel == "grouped":
        return moe_experts_fp8_grouped(*args)
    if kernel == "decode":
        return moe_experts_fp8_decode(*args, one_token=False)
    raise ValueError(f"moe_experts_fp8: kernel must be auto, grouped or decode, got {kernel!r}")
