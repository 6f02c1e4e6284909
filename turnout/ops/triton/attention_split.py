"""Split-KV decode (flash-decoding) for turnout/ops/triton/attention.py: how many programs share one sequence's
context (from host ints only, so there is no device sync and a captured graph serves every length), and the kernel
that merges the splits' normalised partial outputs by their log-sum-exp."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_wait

# Decode only (max_query_len <= _SPLIT_MAX_Q) is split. The split count is fixed from host ints (so a
# captured graph serves every context length); each sequence's own length is cut into that many chunks
# of whole KV tiles at run time, so a short context still spreads over several programs.
_SPLIT_MAX_Q = 1
_MAX_SPLITS = 64
# Aim for this many programs per SM when splitting; with one program per SM already, do not split.
_PROGRAMS_PER_SM = 2


@triton.jit
def _split_reduce_kernel(WS_O, WS_LSE, O, num_splits, stride_wt, stride_wh, stride_ws, stride_lt, stride_lh,
                         stride_ot, stride_oh, SINKS, S_PAD: tl.constexpr, HEAD_D: tl.constexpr,
                         D_PAD: tl.constexpr, PDL: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    """out = sum_s 2^lse_s o_s / sum_s 2^lse_s (lse in log2 units). HAS_SINKS: the head's sink logit (natural
    units, SINKS [H] float32) joins the denominator once, here, not in every split."""
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_D
    lse = tl.load(WS_LSE + t * stride_lt + h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    # o is loaded with lse, not after it (one memory round trip). Every split program of a token writes its
    # rows, an empty split zeros with lse -inf, so no row read here is uninitialised
    o = tl.load(WS_O + t * stride_wt + h * stride_wh + offs_s[:, None] * stride_ws + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(tl.max(lse, 0), sink)
        w = tl.exp2(lse - top)
        out = tl.sum(w[:, None] * o, 0) / (tl.sum(w, 0) + tl.exp2(sink - top))
    else:
        w = tl.exp2(lse - tl.max(lse, 0))  # empty splits have lse -inf: weight 0
        out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(O + t * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_ok)


@functools.cache
def _num_sms(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index or 0).multi_processor_count
    return 8  # the interpreter: small enough that the tests' small batches still split


def choose_num_splits(batch: int, kv_programs: int, max_query_len: int, max_seq_len: int, num_sms: int,
                      min_split_tokens: int = 64) -> int:
    """How many programs share one sequence's context (1: no split). Host ints only. At most one split
    per ``min_split_tokens`` (the KV tile) of ``max_seq_len``."""
    if max_query_len > _SPLIT_MAX_Q:
        return 1
    programs = batch * kv_programs
    if programs >= num_sms:
        return 1
    target = _PROGRAMS_PER_SM * num_sms
    return max(1, min(triton.cdiv(target, programs), triton.cdiv(max_seq_len, min_split_tokens), _MAX_SPLITS))
