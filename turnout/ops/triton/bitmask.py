"""apply_token_bitmask: logits of tokens whose bit is 0 become -inf, in place (turnout/ops/reference/bitmask.py)."""

import torch
import triton
import triton.language as tl

from turnout.ops.reference.bitmask import check_bitmask_args


@triton.jit
def _apply_token_bitmask_kernel(LOGITS, MASK, INDICES, stride_l, stride_m, V, HAS_INDICES: tl.constexpr,
                                BLOCK: tl.constexpr):
    if HAS_INDICES:
        row = tl.load(INDICES + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    # BLOCK is a multiple of 32, so each word is loaded by the 32 lanes that share it (one cache line).
    words = tl.load(MASK + row * stride_m + offs // 32, mask=inside, other=-1)
    allowed = (words >> (offs % 32)) & 1  # arithmetic shift: the & 1 keeps only the wanted bit
    # Only disallowed elements are written: an allowed logit keeps its exact bits.
    tl.store(LOGITS + row * stride_l + offs, tl.full([BLOCK], float("-inf"), LOGITS.dtype.element_ty),
             mask=inside & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None) -> None:
    check_bitmask_args(logits, bitmask, indices)
    b, v = logits.shape
    rows = b if indices is None else indices.numel()
    if rows == 0 or v == 0:
        return
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_token_bitmask: logits and bitmask rows must be contiguous (stride 1 in the vocab)")
    block = min(triton.next_power_of_2(max(v, 32)), 2048)
    grid = (rows, triton.cdiv(v, block))
    idx = indices if indices is not None else bitmask  # unused pointer when HAS_INDICES is off
    _apply_token_bitmask_kernel[grid](logits, bitmask, idx, logits.stride(0), bitmask.stride(0), v,
                                      HAS_INDICES=indices is not None, BLOCK=block, num_warps=4)
