"""moe_experts_fp8 for exactly one token (batch-1 decode), on the CUDA cores: step 3 of
turnout/ops/triton/moe_fp8_decode.py, whose ``moe_experts_fp8_decode`` launches it at T = 1.

The dot kernels have only k x ceil(I/128) programs for one token (48 on Qwen3-30B-A3B, 70.7 us a layer against
bf16's 15.3, docs/benchmarks.md, "fp8 one-row and one-token kernels"), so here one program owns a few weight rows
and every multiprocessor streams weights. The activations are quantised once, by ``_qdq_rows_kernel`` (one
program per row: the quantised values times their scales, float32), before each step, not by every program (in
registers that cost a third of the weights' time at these tiles):

* ``_fp8_one_token_gate_up_kernel``: a program owns one slot and BN columns of I (gate and up rows, inside one
  128-row block each) and streams the whole H, the block scales folded into the token's row, and writes
  silu(gate) * up in float32;
* ``_fp8_one_token_down_kernel``: a program owns BN columns of H (inside one 128-row block of down) and streams
  them for every slot, the block scale and the slot weight folded into the activation vector, so the slots are
  summed in registers.

Apart from moe_fp8_decode.py because these kernels share nothing with its expert-owning dot kernels but the
tile config; the float path has the same split (moe_one_token.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout.ops.reference.fp8 import BLOCK, MIN_SCALE
from turnout.ops.triton._pdl import pdl_args, pdl_wait
from turnout.ops.triton._tuning import interpreted
from turnout.ops.triton.fp8 import quantize_tile
from turnout.ops.triton.moe_decode import _pow2

ROUND = interpreted()  # the interpreter's fp32 -> fp8 cast rounds wrongly: round to e4m3 in float32 first


@triton.jit
def _qdq_rows_kernel(x_ptr, y_ptr, ids_ptr, num_experts, K, stride_x, stride_y, SLOTS: tl.constexpr,
                     MIN_S: tl.constexpr, ROUND_E4M3: tl.constexpr):
    """y[row] = the value of x[row]'s per-128-group fp8 quantisation, float32: one program per row, one group a
    step. The one-token kernels read y, so the quantisation runs once, not once per program. SLOTS: row j is slot
    j's, left alone when its id is outside [0, E) (the gate/up never wrote it)."""
    row = tl.program_id(0).to(tl.int64)
    if SLOTS:
        e = tl.load(ids_ptr + row)
        if (e < 0) | (e >= num_experts):
            return
    ks = tl.arange(0, 128)[None, :]  # one 128-group a step, as a [1, 128] tile for quantize_tile
    for k0 in range(0, K, 128):
        k = k0 + ks
        q, s = quantize_tile(tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32), MIN_S,
                             ROUND_E4M3)
        tl.store(y_ptr + row * stride_y + k, q.to(tl.float8e4nv).to(tl.float32) * s[:, None], mask=k < K)


@triton.jit
def _fp8_one_token_gate_up_kernel(x_ptr, w_ptr, ws_ptr, act_ptr, ids_ptr, num_experts, H, I, NB_I,
                                  stride_we, stride_wn, stride_wse, stride_wsn, stride_act,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """act[j, cols] = silu(g) * u, [g; u] = deq(w13[ids[j], gate/up rows of cols]) @ x, float32, for one token
    whose row x is already quantised and dequantised (``_qdq_rows_kernel``); slots with an id outside [0, E) write
    nothing (the down kernel does not read them)."""
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    j = tl.program_id(0)
    e = tl.load(ids_ptr + j).to(tl.int64)
    if (e < 0) | (e >= num_experts):
        return
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    cols = tl.where(col_ok, cols, 0)
    w_gate = w_ptr + e * stride_we + cols.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    w_up = w_gate + I * stride_wn
    s_gate = ws_ptr + e * stride_wse + ((pid_n * BLOCK_N) // 128) * stride_wsn  # this program's block rows
    s_up = s_gate + NB_I * stride_wsn
    ks = tl.arange(0, BLOCK_K)
    part_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    part_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        k_ok = k < H
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0)  # float32, already quantised and dequantised
        wg = tl.load(w_gate + k[None, :], mask=k_ok[None, :], other=0.0)
        wu = tl.load(w_up + k[None, :], mask=k_ok[None, :], other=0.0)
        part_g += wg.to(tl.float32) * (x * tl.load(s_gate + k // 128, mask=k_ok, other=0.0))[None, :]
        part_u += wu.to(tl.float32) * (x * tl.load(s_up + k // 128, mask=k_ok, other=0.0))[None, :]
    g = tl.sum(part_g, axis=1)
    u = tl.sum(part_u, axis=1)
    tl.store(act_ptr + j * stride_act + cols, g * tl.sigmoid(g) * u, mask=col_ok)


@triton.jit
def _fp8_one_token_down_kernel(act_ptr, w_ptr, ws_ptr, weights_ptr, out_ptr, ids_ptr,
                               top_k, num_experts, H, I,
                               stride_act, stride_we, stride_wn, stride_wse, stride_wsn,
                               KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[0, cols] = sum_j weight[j] * act[j] @ deq(w2[ids[j], cols]).T for one token, in registers (act: the
    gate/up's output quantised and dequantised by ``_qdq_rows_kernel``). BLOCK_N divides 128, so along K the block
    scale of this program's rows is one value per 128 columns."""
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    cols = tl.where(col_ok, cols, 0)
    slots = tl.arange(0, KP)
    ids = tl.load(ids_ptr + slots, mask=slots < top_k, other=-1).to(tl.int64)  # [KP]
    valid = (slots < top_k) & (ids >= 0) & (ids < num_experts)
    ids = tl.where(valid, ids, 0)
    scale = tl.where(valid, tl.load(weights_ptr + slots, mask=slots < top_k, other=0.0), 0.0)  # [KP] fp32
    block_row = ((pid * BLOCK_N) // 128) * stride_wsn
    ks = tl.arange(0, BLOCK_K)
    n_k = tl.cdiv(I, BLOCK_K)
    part = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for it in range(0, top_k * n_k):  # (slot, K tile) in one loop, so the loads pipeline across slots
        j = it // n_k
        k = (it - j * n_k) * BLOCK_K + ks
        pick = slots == j
        e = tl.sum(tl.where(pick, ids, 0), axis=0)
        ok = (k < I) & ((ks * 0 + tl.sum(tl.where(pick, valid.to(tl.int32), 0), axis=0)) > 0)  # [BK]
        s = tl.sum(tl.where(pick, scale, 0.0), axis=0)
        w = tl.load(w_ptr + e * stride_we + cols.to(tl.int64)[:, None] * stride_wn + k[None, :],
                    mask=(k < I)[None, :], other=0.0)
        a = tl.load(act_ptr + j * stride_act + k, mask=ok, other=0.0)  # float32, quantised and dequantised
        a = a * tl.load(ws_ptr + e * stride_wse + block_row + k // 128, mask=ok, other=0.0)
        part += w.to(tl.float32) * (a * s)[None, :]
    tl.store(out_ptr + cols, tl.sum(part, axis=1).to(out_ptr.dtype.element_ty), mask=col_ok)


def moe_experts_fp8_one_token(hidden, w13, w13_scale, w2, w2_scale, weights, ids, cfg) -> torch.Tensor:
    """moe_experts_fp8 for one token (hidden [1, H]; weights float32 and ids contiguous [1, k]); ``cfg``: the
    Fp8DecodeConfig's one-token fields."""
    hidden_size = hidden.shape[1]
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = ids.shape[1]
    kp = _pow2(top_k)
    out = torch.empty_like(hidden)
    xq = torch.empty(1, hidden_size, dtype=torch.float32, device=hidden.device)
    _qdq_rows_kernel[(1,)](hidden, xq, ids, num_experts, hidden_size, hidden.stride(0), xq.stride(0),
                           SLOTS=False, MIN_S=MIN_SCALE, ROUND_E4M3=ROUND, num_warps=4)
    act = torch.empty(top_k, inter, dtype=torch.float32, device=hidden.device)
    bn = max(1, min(cfg.block_n_one_up, 128, _pow2(inter)))
    bk = max(16, min(cfg.block_k_one_up, _pow2(hidden_size)))
    _fp8_one_token_gate_up_kernel[(top_k, triton.cdiv(inter, bn))](
        xq, w13, w13_scale, act, ids, num_experts, hidden_size, inter, triton.cdiv(inter, BLOCK),
        w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), act.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg.num_warps_one_up,
        num_stages=1 if ROUND else cfg.num_stages_one_up, **pdl_args(hidden, "moe_gate_up"))
    _qdq_rows_kernel[(top_k,)](act, act, ids, num_experts, inter, act.stride(0), act.stride(0), SLOTS=True,
                               MIN_S=MIN_SCALE, ROUND_E4M3=ROUND, num_warps=4)  # in place
    bn = max(1, min(cfg.block_n_one, 128, _pow2(hidden_size)))
    bk = max(16, min(cfg.block_k_one, _pow2(inter)))
    _fp8_one_token_down_kernel[(triton.cdiv(hidden_size, bn),)](
        act, w2, w2_scale, weights, out, ids, top_k, num_experts, hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        KP=kp, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg.num_warps_one,
        num_stages=1 if ROUND else cfg.num_stages_one, **pdl_args(hidden, "moe_down"))
    return out
