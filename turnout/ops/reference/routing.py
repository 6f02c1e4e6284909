"""select_experts: THE routing of an MoE layer (DESIGN.md, "MoE routing contract").

The layer's ``turnout.layers.moe.router.select_experts(logits, RoutingConfig, ...)`` calls this op; its
PyTorch reference below is the meaning every implementation must match, id for id.
"""

import torch

from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase


def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, largest first; equal values: the lower index first (deterministic)."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def select_experts(router_logits: torch.Tensor, top_k: int, scoring: str, softmax_after_topk: bool, n_group: int,
                   topk_group: int, renormalize: bool, routed_scaling_factor: float,
                   e_score_correction_bias: torch.Tensor | None = None,
                   per_expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights fp32 [T, k], topk_ids int32 [T, k]), ids by descending choice.

    Scores are softmax or sigmoid of the float32 logits (Mixtral, ``softmax_after_topk``: top-k of the
    logits, then softmax over those k). The correction bias is added for choosing only. Grouped top-k
    (``n_group`` > 1): groups ranked by the sum of their top-2 biased scores when a bias is given, by
    their max otherwise; the experts of dropped groups are masked to -inf. Then the weights are the
    chosen experts' scores, optionally renormalised, times ``routed_scaling_factor``, times the learnable
    ``per_expert_scale[id]``.
    """
    logits = router_logits.float()
    num_tokens, num_experts = logits.shape
    if softmax_after_topk:
        top_logits, topk_ids = stable_topk(logits, top_k)
        topk_weights = torch.softmax(top_logits, dim=-1)
    else:
        scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
        choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
        if n_group > 1:
            grouped = choice.view(num_tokens, n_group, num_experts // n_group)
            if e_score_correction_bias is not None:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
            else:
                group_scores = grouped.amax(dim=-1)  # [T, n_group]
            _, kept_groups = stable_topk(group_scores, topk_group)
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        _, topk_ids = stable_topk(choice, top_k)
        topk_weights = scores.gather(1, topk_ids)
    if renormalize and not softmax_after_topk:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    if per_expert_scale is not None:
        topk_weights = topk_weights * per_expert_scale.float()[topk_ids]
    return topk_weights.contiguous(), topk_ids.to(torch.int32).contiguous()


def _samples(device, dtype, gen):
    # (T, E, k, scoring, softmax_after_topk, n_group, topk_group, renormalize, scaling, bias, scale)
    cases = [
        (1, 128, 8, "softmax", False, 1, 1, True, 1.0, False, False),  # Qwen3-MoE decode
        (33, 60, 4, "softmax", False, 1, 1, False, 1.0, False, False),  # Qwen2-MoE
        (17, 8, 2, "softmax", True, 1, 1, False, 1.0, False, False),  # Mixtral
        (9, 160, 8, "sigmoid", False, 1, 1, True, 2.5, True, False),  # GLM-4.5 (noaux_tc, one group)
        (12, 64, 6, "sigmoid", False, 8, 4, True, 2.5, True, True),  # DeepSeek-V3-like groups + learnable scale
        (5, 32, 4, "softmax", False, 4, 2, False, 1.0, False, True),  # groups ranked by max, per-expert scale
        (7, 64, 6, "softmax", False, 1, 1, True, 1.0, True, False),  # ERNIE-4.5: softmax, aux-free bias, k = 6
        (6, 24, 3, "softmax", True, 1, 1, False, 1.0, False, False),  # softmax after a top-k of 3
    ]
    for t, e, k, scoring, after, ng, tg, renorm, scale_f, bias, scale in cases:
        logits = randn((t, e), dtype, device, gen, 2.0)
        b = randn((e,), torch.float32, device, gen, 0.1) if bias else None
        s = (randn((e,), torch.float32, device, gen, 0.5) + 1.0) if scale else None
        yield SampleCase(f"T{t}-E{e}-k{k}-{scoring}{'-after' if after else ''}-g{ng}/{tg}"
                         f"{'-bias' if bias else ''}{'-scale' if scale else ''}",
                         (logits, k, scoring, after, ng, tg, renorm, scale_f, b, s))


SELECT_EXPERTS = OpSpec(
    "select_experts", select_experts, _samples,
    tolerance={"float32": (1e-6, 1e-5), "float16": (1e-6, 1e-5), "bfloat16": (1e-6, 1e-5)},
    doc="MoE routing: scores, (grouped) top-k with correction bias, renormalise, scale, per-expert scale")
