"""moe_experts_fp8 for few tokens (decode): the kernels of turnout/ops/triton/moe_decode.py on fp8 weights.

The same shape of work as the float decode path (no sort: each program owns one expert and one column tile, and
finds its (token, slot) pairs by scanning the ids; ``_owned_expert`` / ``_chunk_pairs`` are that module's), with
the K loop stepping by 128, one scale group:

1. ``_fp8_gate_up_kernel``: each 128-wide K tile of the token rows is quantised in registers as ``quantize_fp8``
   does it (``quantize_tile`` of ops/triton/fp8.py: max |x| / 448 of the row's group, x / s rounded to e4m3), so no quantisation kernel runs before it;
   the fp8 x fp8 ``tl.dot`` of the tile is added into float32 accumulators times the row's group scale and the
   weight block's (a program's 128 columns of I lie in one block of the gate and one of the up). The epilogue
   quantises silu(gate) * up the same way: a program's 128 columns are one group, so it writes the fp8
   activations and their scale [T*k, ceil(I/128)] itself.
2. ``_fp8_down_kernel``: fp8 activations x fp8 down weights per 128 K tile, times both scales, times the routing
   weight, into per-pair float32 rows; then moe_decode's slot sum.
3. one token (batch-1 decode): both steps on the CUDA cores, one program per few weight rows so that every
   multiprocessor streams weights (turnout/ops/triton/moe_fp8_one_token.py, which says why).

Each 128-wide tile's product is added into float32 separately (the promotion interval of ops/triton/fp8.py: on sm90
an fp8 dot accumulates in reduced precision). Under TRITON_INTERPRET=1 the quantised values are rounded to the
e4m3 grid in float32 first (``round_e4m3``: the interpreter's fp32 -> fp8 cast rounds wrongly); compiled kernels
cast directly. The routing is consumed as given:
the router's ids and weights already hold its per-expert scale and bias (turnout/layers/moe/router.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from turnout.ops.reference.fp8 import BLOCK, FP8, MIN_SCALE
from turnout.ops.triton._pdl import pdl_args, pdl_wait
from turnout.ops.triton._tuning import interpreted
from turnout.ops.triton.fp8 import quantize_tile
from turnout.ops.triton.moe_decode import _chunk_pairs, _owned_expert, _pow2, _sum_slots_kernel
from turnout.ops.triton.moe_fp8_one_token import moe_experts_fp8_one_token

ROUND = interpreted()


@dataclass(frozen=True)
class Fp8DecodeConfig:
    """Tiles of the fp8 decode kernels; K steps by 128 and gate/up's columns are 128 (one scale group). Not swept
    on the H200 yet: the float path's measured choices at the same bytes per tile (fp8 128 columns = bf16 64)."""

    block_m: int = 16
    block_n2: int = 64  # down: columns of H per program when a program serves one slot (T*k < E)
    block_n2_many: int = 128  # ... when every expert has a program
    num_warps: int = 4
    num_stages: int = 4
    num_stages_many: int = 3
    block_n_one: int = 8  # one token, down: columns of H per program (divides 128), the whole I in one K tile
    block_k_one: int = 1024
    num_warps_one: int = 8
    num_stages_one: int = 4
    # one token, gate/up: columns of I per program (divides 128) and its K tile over H: the fastest of 20 on
    # Qwen3-30B-A3B on the H200 (benchmarks/moe_fp8_one_token.py, the whole op from a CUDA graph: 36.1 us against
    # 39.5 for 4 x 1024 x 4 warps; bf16 moe_experts 27.0; docs/benchmarks.md, "fp8 one-row and one-token kernels")
    block_n_one_up: int = 8
    block_k_one_up: int = 512
    num_warps_one_up: int = 8
    num_stages_one_up: int = 3


DEFAULT = Fp8DecodeConfig()


@triton.jit
def _fp8_gate_up_kernel(x_ptr, w_ptr, ws_ptr, aq_ptr, as_ptr, ids_ptr,
                        num_pairs, top_k, num_experts, H, I, NB_I,
                        stride_xt, stride_we, stride_wn, stride_wse, stride_wsn, stride_aq, stride_as,
                        SCAN: tl.constexpr, BLOCK_M: tl.constexpr, BY_SLOT: tl.constexpr, MIN_S: tl.constexpr,
                        ROUND_E4M3: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    expert, count = _owned_expert(ids_ptr, num_pairs, num_experts, SCAN, BY_SLOT)
    if count == 0:
        return
    pid_n = tl.program_id(1)
    cols = pid_n * 128 + tl.arange(0, 128)
    col_ok = cols < I
    cols = tl.where(col_ok, cols, 0)  # in-bounds addresses; those columns are zeroed before the epilogue's max
    w_gate = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + I * stride_wn
    s_gate = ws_ptr + expert * stride_wse + pid_n * stride_wsn  # the gate's block row of these columns
    s_up = s_gate + NB_I * stride_wsn
    for c0 in range(0, count, BLOCK_M):
        pairs, row_ok = _chunk_pairs(ids_ptr, expert, num_pairs, c0, count, SCAN, BLOCK_M)
        x_rows = x_ptr + (pairs // top_k).to(tl.int64)[:, None] * stride_xt
        acc_gate = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
        for k0 in range(0, H, 128):
            ks = k0 + tl.arange(0, 128)
            k_ok = ks < H
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            q, s = quantize_tile(x, MIN_S, ROUND_E4M3)
            a = q.to(w_ptr.dtype.element_ty)
            wg = tl.load(w_gate + ks[:, None], mask=k_ok[:, None], other=0.0)  # [128, 128] fp8
            wu = tl.load(w_up + ks[:, None], mask=k_ok[:, None], other=0.0)
            kb = k0 // 128
            acc_gate += tl.dot(a, wg) * (s * tl.load(s_gate + kb))[:, None]
            acc_up += tl.dot(a, wu) * (s * tl.load(s_up + kb))[:, None]
        act = tl.where(col_ok[None, :], acc_gate * tl.sigmoid(acc_gate) * acc_up, 0.0)
        q, s = quantize_tile(act, MIN_S, ROUND_E4M3)
        tl.store(aq_ptr + pairs.to(tl.int64)[:, None] * stride_aq + cols[None, :], q.to(aq_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
        tl.store(as_ptr + pairs.to(tl.int64) * stride_as + pid_n, s, mask=row_ok)


@triton.jit
def _fp8_down_kernel(aq_ptr, as_ptr, w_ptr, ws_ptr, weights_ptr, out_ptr, ids_ptr,
                     num_pairs, num_experts, H, I,
                     stride_aq, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
                     SCAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BY_SLOT: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    expert, count = _owned_expert(ids_ptr, num_pairs, num_experts, SCAN, BY_SLOT)
    if count == 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    cols = tl.where(col_ok, cols, 0)
    w_rows = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    ws_rows = ws_ptr + expert * stride_wse + (cols // 128) * stride_wsn  # [BN]: each column's block row
    for c0 in range(0, count, BLOCK_M):
        pairs, row_ok = _chunk_pairs(ids_ptr, expert, num_pairs, c0, count, SCAN, BLOCK_M)
        a_rows = aq_ptr + pairs.to(tl.int64)[:, None] * stride_aq
        s_rows = as_ptr + pairs.to(tl.int64) * stride_as
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, 128):
            ks = k0 + tl.arange(0, 128)
            k_ok = ks < I
            a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, 128] fp8
            w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None], other=0.0)  # [128, BN] fp8
            kb = k0 // 128
            sa = tl.load(s_rows + kb, mask=row_ok, other=0.0)
            acc += tl.dot(a, w) * sa[:, None] * tl.load(ws_rows + kb)[None, :]
        weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)  # [BM] fp32
        tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :], acc * weight[:, None],
                 mask=row_ok[:, None] & col_ok[None, :])


def _fit(block: int, n: int) -> int:
    return max(16, min(block, _pow2(n)))


def gate_up(hidden, w13, w13_scale, ids, num_pairs: int, by_slot: bool, cfg: Fp8DecodeConfig):
    """Step 1: (fp8 activations [T*k, I], their scales float32 [T*k, ceil(I/128)]), rows by pair."""
    num_experts, two_i, hidden_size = w13.shape
    inter = two_i // 2
    nb_i = triton.cdiv(inter, BLOCK)
    aq = torch.empty(num_pairs, inter, dtype=FP8, device=hidden.device)
    a_s = torch.empty(num_pairs, nb_i, dtype=torch.float32, device=hidden.device)
    grid0 = num_pairs if by_slot else num_experts
    _fp8_gate_up_kernel[(grid0, nb_i)](
        hidden, w13, w13_scale, aq, a_s, ids, num_pairs, ids.shape[1], num_experts, hidden_size, inter, nb_i,
        hidden.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), aq.stride(0),
        a_s.stride(0), SCAN=max(16, min(128, _pow2(num_pairs))), BLOCK_M=cfg.block_m, BY_SLOT=by_slot,
        MIN_S=MIN_SCALE, ROUND_E4M3=ROUND, num_warps=cfg.num_warps,
        num_stages=1 if ROUND else cfg.num_stages if by_slot else cfg.num_stages_many,
        **pdl_args(hidden, "moe_gate_up"))
    return aq, a_s


def moe_experts_fp8_decode(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, one_token: bool = True,
                           config: Fp8DecodeConfig | None = None) -> torch.Tensor:
    """moe_experts_fp8 (turnout/ops/reference/moe_fp8.py) for few pairs; correct for any T, fast for small.
    ``one_token``: at T = 1 the one-token kernels of step 3 (else the dot kernels, per-slot rows, then the sum)."""
    cfg = config or DEFAULT
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.float().contiguous()
    by_slot = num_pairs < num_experts
    if num_tokens == 1 and one_token:
        return moe_experts_fp8_one_token(hidden, w13, w13_scale, w2, w2_scale, weights, ids, cfg)
    out = torch.empty_like(hidden)
    kp = _pow2(top_k)
    aq, a_s = gate_up(hidden, w13, w13_scale, ids, num_pairs, by_slot, cfg)
    bn2 = _fit(cfg.block_n2 if by_slot else cfg.block_n2_many, hidden_size)
    pair_out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    _fp8_down_kernel[(num_pairs if by_slot else num_experts, triton.cdiv(hidden_size, bn2))](
        aq, a_s, w2, w2_scale, weights, pair_out, ids, num_pairs, num_experts, hidden_size, inter,
        aq.stride(0), a_s.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        pair_out.stride(0), SCAN=max(16, min(128, _pow2(num_pairs))), BLOCK_M=cfg.block_m, BLOCK_N=bn2,
        BY_SLOT=by_slot, num_warps=cfg.num_warps, num_stages=1 if ROUND else 3, **pdl_args(hidden))
    block_h = max(16, min(_pow2(hidden_size), 4096 // kp))
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        pair_out, ids, out, top_k, num_experts, hidden_size, pair_out.stride(0), out.stride(0),
        KP=kp, BLOCK_H=block_h, num_warps=4, **pdl_args(hidden))
    return out
