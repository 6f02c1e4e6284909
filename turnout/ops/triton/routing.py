"""select_experts in one Triton kernel per token row: scores, correction bias, top-k by repeated argmax
(lower id wins ties, as the reference's stable sort), weights, renormalisation, scaling, per-expert scale.

One launch replaces the ~8 small torch kernels of the reference (softmax, sort, gathers, sums), which
dominate MoE routing at decode batch sizes. Grouped top-k (``n_group`` > 1) is computed by the
reference implementation: this kernel covers the ungrouped families (Qwen2/3-MoE, Mixtral, GLM-4.5).
"""

import torch
import triton
import triton.language as tl

from turnout.ops.reference import routing as ref
from turnout.ops.triton._pdl import pdl_args, pdl_wait


@triton.jit
def _route_kernel(LOGITS, BIAS, SCALE, W_OUT, ID_OUT, E, stride_row, scaling,
                  K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr,
                  AFTER_TOPK: tl.constexpr,
                  RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    x = tl.load(LOGITS + row.to(tl.int64) * stride_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
    if AFTER_TOPK:
        scores = x
    elif SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        m = tl.max(x, 0)
        p = tl.where(ok, tl.exp(x - m), 0.0)
        scores = p / tl.sum(p, 0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(BIAS + offs, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    ks = tl.arange(0, K_PAD)  # K rounded up to a power of two (tl.arange needs one); slots past K stay unused
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    w = tl.zeros([K_PAD], dtype=tl.float32)
    for i in tl.static_range(K):
        best = tl.max(choice, 0)
        idx = tl.min(tl.where(choice == best, offs, BLOCK_E), 0)
        hit = offs == idx
        ids = tl.where(ks == i, idx, ids)
        w = tl.where(ks == i, tl.sum(tl.where(hit, scores, 0.0), 0), w)
        choice = tl.where(hit, float("-inf"), choice)
    if AFTER_TOPK:  # Mixtral: softmax over the k chosen logits
        w = tl.where(ks < K, w, float("-inf"))
        e = tl.exp(w - tl.max(w, 0))
        w = e / tl.sum(e, 0)
    elif RENORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    w = w * scaling
    if HAS_SCALE:
        w = w * tl.load(SCALE + ids).to(tl.float32)
    tl.store(W_OUT + row * K + ks, w, mask=ks < K)
    tl.store(ID_OUT + row * K + ks, ids, mask=ks < K)


def select_experts(router_logits: torch.Tensor, top_k: int, scoring: str, softmax_after_topk: bool, n_group: int,
                   topk_group: int, renormalize: bool, routed_scaling_factor: float,
                   e_score_correction_bias: torch.Tensor | None = None,
                   per_expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = router_logits.shape
    if n_group > 1 or e > 4096:  # grouped top-k: the reference
        return ref.select_experts(router_logits, top_k, scoring, softmax_after_topk, n_group, topk_group,
                                  renormalize, routed_scaling_factor, e_score_correction_bias, per_expert_scale)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    bias = e_score_correction_bias if e_score_correction_bias is not None else weights
    scale = per_expert_scale if per_expert_scale is not None else weights
    _route_kernel[(t,)](logits, bias, scale, weights, ids, e, logits.stride(0), float(routed_scaling_factor),
                        K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(e),
                        SIGMOID=scoring == "sigmoid",
                        AFTER_TOPK=bool(softmax_after_topk), RENORM=bool(renormalize),
                        HAS_BIAS=e_score_correction_bias is not None, HAS_SCALE=per_expert_scale is not None,
                        num_warps=4 if e > 256 else 1, **pdl_args(logits, "routing"))
    return weights, ids
