"""moe_experts kernels for exactly one token (batch-1 decode), on the CUDA cores.

One token reads each of its k experts' weights once, and there is nothing to share between slots, so these
kernels drop the expert ownership scan and the padded ``tl.dot`` of turnout/ops/triton/moe_decode.py:

* ``one_token_gate_up_kernel``: one program per (slot, BN columns of I), whole-K tiles of the gate and up
  rows multiplied on the CUDA cores (off by default: not yet measured on a GPU, ``DecodeConfig``);
* ``one_token_down_kernel``: one program per BN columns of H streams those rows of all k experts in one
  pipelined loop, with the slot weight folded into the activation, so the slots are summed in registers
  and no sum kernel is needed (the default for one token: docs/benchmarks.md, fifth session).

``moe_experts_decode`` launches them; the routing is consumed as given (seed 001).
"""

import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_wait


@triton.jit
def one_token_gate_up_kernel(x_ptr, w13_ptr, act_ptr, ids_ptr, num_experts, H, I, stride_we, stride_wn,
                              stride_act, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                              PDL: tl.constexpr):
    """act[j, cols] = silu(x @ w13[e, cols].T) * (x @ w13[e, I + cols].T) for one token's slot j (e = ids[j]).

    One program per (slot, BN columns): the gate and up rows stream in whole-K tiles on the CUDA cores into
    [BN, BK] fp32 partials reduced once. A slot whose id is outside [0, E) writes nothing (nor is its row
    read later). Duplicate ids compute the same row twice; each slot owns its own act row."""
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    j = tl.program_id(0)
    e = tl.load(ids_ptr + j).to(tl.int64)
    if (e < 0) | (e >= num_experts):
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    cols = tl.where(col_ok, cols, 0)
    w_gate = w13_ptr + e * stride_we + cols.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    w_up = w_gate + I * stride_wn
    ks = tl.arange(0, BLOCK_K)
    part_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    part_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptr + k0 + ks).to(tl.float32)[None, :]
            wg = tl.load(w_gate + (k0 + ks)[None, :])
            wu = tl.load(w_up + (k0 + ks)[None, :])
        else:
            k_ok = (k0 + ks) < H
            a = tl.load(x_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            wg = tl.load(w_gate + (k0 + ks)[None, :], mask=k_ok[None, :], other=0.0)
            wu = tl.load(w_up + (k0 + ks)[None, :], mask=k_ok[None, :], other=0.0)
        part_g += wg.to(tl.float32) * a
        part_u += wu.to(tl.float32) * a
    g = tl.sum(part_g, axis=1)
    u = tl.sum(part_u, axis=1)
    tl.store(act_ptr + j.to(tl.int64) * stride_act + cols, (g * tl.sigmoid(g) * u).to(act_ptr.dtype.element_ty),
             mask=col_ok)


@triton.jit
def one_token_down_kernel(act_ptr, w2_ptr, weights_ptr, out_ptr, ids_ptr,
                           top_k, num_experts, H, I, stride_act, stride_we, stride_wn,
                           KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                           PDL: tl.constexpr):
    """out[0, cols] = sum_j weight[j] * act[j] @ w2[ids[j], cols].T for one token, summed in registers.

    The slot weight scales the activation before the products, so one [BN, BK] fp32 partial serves every
    slot and is reduced across lanes once. Slots with an id outside [0, E) contribute nothing (their
    activation rows were never written, so they are not read)."""
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    cols = tl.where(col_ok, cols, 0)
    slots = tl.arange(0, KP)
    ids = tl.load(ids_ptr + slots, mask=slots < top_k, other=-1).to(tl.int64)  # [KP]
    valid = (slots < top_k) & (ids >= 0) & (ids < num_experts)
    ids = tl.where(valid, ids, 0)
    scale = tl.where(valid, tl.load(weights_ptr + slots, mask=slots < top_k, other=0.0), 0.0)  # [KP] fp32
    ks = tl.arange(0, BLOCK_K)
    n_k = tl.cdiv(I, BLOCK_K)
    part = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for it in range(0, top_k * n_k):  # (slot, K tile) in one loop, so the loads pipeline across slots
        j = it // n_k
        k0 = (it - j * n_k) * BLOCK_K
        pick = slots == j
        e = tl.sum(tl.where(pick, ids, 0), axis=0)
        ok = (ks * 0 + tl.sum(tl.where(pick, valid.to(tl.int32), 0), axis=0)) > 0  # [BK]: the slot's id is valid
        s = tl.sum(tl.where(pick, scale, 0.0), axis=0)
        w_rows = w2_ptr + e * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        if EVEN_K:
            w = tl.load(w_rows + (k0 + ks)[None, :])
            a = tl.load(act_ptr + j * stride_act + k0 + ks, mask=ok, other=0.0)
        else:
            k_ok = (k0 + ks) < I
            w = tl.load(w_rows + (k0 + ks)[None, :], mask=k_ok[None, :], other=0.0)
            a = tl.load(act_ptr + j * stride_act + k0 + ks, mask=ok & k_ok, other=0.0)
        part += w.to(tl.float32) * (a.to(tl.float32) * s)[None, :]
    tl.store(out_ptr + cols, tl.sum(part, axis=1).to(out_ptr.dtype.element_ty), mask=col_ok)
