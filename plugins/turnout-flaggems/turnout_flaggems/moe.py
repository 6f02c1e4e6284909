"""MoE routing and experts through FlagGems, in turnout's contracts (turnout/ops/reference/routing.py, moe.py,
moe_fp8.py). Routing variants FlagGems lacks go to ``fallback`` (the next implementation in the policy's order),
with the reason logged once: turnout routes once, so a variant computed wrongly here would reach every expert
backend."""

from __future__ import annotations

import functools

import torch

from turnout_flaggems.library import decline

_MAX_TOPK = 32  # FlagGems' routing kernels keep at most 32 choices per token
BLOCK = 128  # turnout's fp8 blocks and groups


def _routing_refusal(top_k, scoring, softmax_after_topk, n_group, bias, per_expert_scale) -> str | None:
    if softmax_after_topk:
        return "softmax after top-k (FlagGems' routing takes the scores of all experts)"
    if per_expert_scale is not None:
        return "a learnable per-expert scale (FlagGems' routing has none)"
    if top_k > _MAX_TOPK:
        return f"top_k {top_k} > {_MAX_TOPK}"
    if scoring == "softmax" and n_group <= 1 and bias is None:
        return None  # topk_softmax
    if top_k & (top_k - 1):
        return f"top_k {top_k} is not a power of two (FlagGems' grouped_topk keeps its choices in a power-of-two tile)"
    if n_group > 1 and bias is None:
        return "groups ranked by their max (FlagGems' grouped_topk ranks groups by their top-2 sum)"
    if n_group > _MAX_TOPK:
        return f"{n_group} groups > {_MAX_TOPK}"
    return None


def select_experts(router_logits, top_k, scoring, softmax_after_topk, n_group, topk_group, renormalize,
                   routed_scaling_factor, e_score_correction_bias=None, per_expert_scale=None, *, gems, fallback):
    """Softmax routing without groups or bias: ``topk_softmax`` (writes weights and ids into given tensors),
    then the scaling factor. Sigmoid, a correction bias or groups: ``grouped_topk`` (scoring_func 1 is sigmoid
    inside it; softmax scores are computed here and passed with scoring_func 0; without a bias it gets zeros,
    which with one group choose exactly as no bias). Scores in float32, as the reference computes them."""
    why = _routing_refusal(top_k, scoring, softmax_after_topk, n_group, e_score_correction_bias, per_expert_scale)
    if why is not None:
        decline("select_experts", why)
        return fallback(router_logits, top_k, scoring, softmax_after_topk, n_group, topk_group, renormalize,
                        routed_scaling_factor, e_score_correction_bias, per_expert_scale)
    logits = router_logits.float().contiguous()
    num_tokens, num_experts = logits.shape
    if scoring == "softmax" and n_group <= 1 and e_score_correction_bias is None:
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
        rows = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
        gems.topk_softmax(weights, ids, rows, logits, renormalize)
        if routed_scaling_factor != 1.0:
            weights.mul_(routed_scaling_factor)
        return weights, ids
    if scoring == "softmax":
        scores, scoring_func = torch.softmax(logits, dim=-1), 0
    else:
        scores, scoring_func = logits, 1
    bias = (torch.zeros(num_experts, dtype=torch.float32, device=logits.device) if e_score_correction_bias is None
            else e_score_correction_bias.float())
    groups = max(n_group, 1)
    weights, ids = gems.grouped_topk(scores, groups, max(topk_group, 1) if groups > 1 else 1, top_k, renormalize,
                                     float(routed_scaling_factor), bias, scoring_func)
    return weights.float(), ids.to(torch.int32)


@functools.cache
def _hopper(device) -> bool:  # asked per layer per step: once per device
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _local(topk_weights, topk_ids, num_experts):
    """turnout's ids outside [0, E) are experts of another rank and contribute nothing; FlagGems' kernels
    index every id. Such slots point at expert 0 with weight 0 instead (no host sync, no branch)."""
    ok = (topk_ids >= 0) & (topk_ids < num_experts)
    return (torch.where(ok, topk_weights.float(), 0.0),
            torch.where(ok, topk_ids, 0).to(torch.int32))


def moe_experts(hidden, w13, w2, topk_weights, topk_ids, *, gems, fallback):
    """``fused_experts_impl`` with turnout's layout as is: w13 [E, 2I, H] gate rows then up rows (its w1, SiLU
    of the first half times the second), w2 [E, H, I]; the routing exactly as given. float32 goes to the next
    implementation: FlagGems' kernel multiplies float32 at a lower precision (errors of 0.006-0.016 against
    the reference's 1e-4 in turnout's conformance on an H100, 2026-12-07)."""
    if hidden.dtype == torch.float32:
        decline("moe_experts", "float32 (FlagGems' experts kernel multiplies it at a lower precision)")
        return fallback(hidden, w13, w2, topk_weights, topk_ids)
    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    weights, ids = _local(topk_weights, topk_ids, w13.shape[0])
    return gems.fused_experts_impl(hidden.contiguous(), w13, w2, weights, ids)


def moe_experts_fp8(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, *, gems, fallback):
    """``fused_experts_impl(use_fp8_w8a8=True, block_shape=[128, 128])``: 128 x 128 weight blocks, activations
    quantised per token and 128 group, as turnout's contract. turnout keeps the gate's blocks, then the up's
    (2 ceil(I/128) rows of scales); FlagGems reads ceil(2I/128) over gate and up together, and its activation
    quantisation needs whole groups: the same only when I and H are multiples of 128."""
    inter, hidden_size = w13.shape[1] // 2, w13.shape[2]
    if inter % BLOCK or hidden_size % BLOCK:
        decline("moe_experts_fp8", f"I = {inter} or H = {hidden_size} not a multiple of {BLOCK} (FlagGems' "
                "fp8 blocks span gate and up, and its activation groups must be whole)")
        return fallback(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    if _hopper(hidden.device) and 32 < hidden.shape[0] * topk_ids.shape[1] // w13.shape[0] <= 48:
        # FlagGems 5.0.2 picks a 48-row tile on Hopper for 33-48 routed tokens per expert, which Triton cannot
        # compile (tl.arange needs a power of 2): seen in turnout's conformance on an H100, 2026-12-07
        decline("moe_experts_fp8", "33-48 routed tokens per expert on Hopper (FlagGems 5.0.2 picks a 48-row tile "
                "there, which does not compile)")
        return fallback(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    weights, ids = _local(topk_weights, topk_ids, w13.shape[0])
    return gems.fused_experts_impl(hidden.contiguous(), w13, w2, weights, ids, use_fp8_w8a8=True,
                                   w1_scale=w13_scale, w2_scale=w2_scale, block_shape=[BLOCK, BLOCK])
