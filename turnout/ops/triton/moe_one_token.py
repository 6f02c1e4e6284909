"""The moe_experts down kernel for exactly one token (batch-1 decode), on the CUDA cores.

One token reads each of its k experts' weights once, and there is nothing to share between slots, so this
kernel drops the expert ownership scan and the padded ``tl.dot`` of turnout/ops/triton/moe_decode.py:
``one_token_down_kernel``, one program per BN columns of H, streams those rows of all k experts in one
pipelined loop, with the slot weight folded into the activation, so the slots are summed in registers
and no sum kernel is needed (the default for one token: docs/benchmarks.md, "norms fused into projections").

A gate/up counterpart (one program per slot and BN columns of I, whole-K tiles on the CUDA cores) lost to
the ``tl.dot`` gate/up kernel in the captured step, 2.672 against 2.604 ms (docs/benchmarks.md, "RoPE inside
attention by default"), and was removed.

``moe_experts_decode`` launches it; the routing is consumed as given:
the router's ids and weights already hold its per-expert scale and bias (turnout/layers/moe/router.py).
"""

import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_wait


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
