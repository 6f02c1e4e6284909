"""Expert selection: THE one place where MoE routing happens (DESIGN.md, "MoE routing contract").

``select_experts`` turns router logits into ``(topk_weights fp32 [T, k], topk_ids int32 [T, k])``. Every
expert backend (the ``moe_experts`` op) consumes exactly these tensors and never recomputes top-k: a
backend that re-derived the ids from scores would silently drop the per-expert scale applied here.

Rules, in order:

1. scores: ``softmax`` or ``sigmoid`` of the logits in float32 (Mixtral: ``softmax_after_topk``, i.e. top-k
   of the logits, then softmax over the k chosen -- the same numbers as softmax, top-k, renormalise);
2. choice scores = scores + ``e_score_correction_bias`` (the bias chooses experts, it never weights them);
3. grouped top-k (``n_group`` > 1): groups ranked by the sum of their top-2 choice scores when a correction
   bias is present (DeepSeek-V3 / GLM-4.5 ``noaux_tc``), by their max otherwise (DeepSeek-V2
   ``group_limited_greedy``); the experts of the groups not among the best ``topk_group`` are masked to
   -inf (not 0: sigmoid scores and biased scores can be negative or zero and would still win);
4. top-k of the choice scores; ties go to the lower expert id (a stable sort, not ``torch.topk``, whose
   tie order is unspecified and differs between devices);
5. weights = the unbiased scores of the chosen experts; ``renormalize`` divides by their sum;
6. ``routed_scaling_factor`` multiplies;
7. the learnable per-expert scale multiplies: ``w *= per_expert_scale[ids]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    softmax_after_topk: bool = False
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    # What the layer must hold (the tensors themselves are arguments of select_experts):
    has_correction_bias: bool = False
    has_per_expert_scale: bool = False

    def __post_init__(self):
        def bad(why):
            raise ValueError(f"RoutingConfig: {why}")

        if self.scoring not in SCORINGS:
            bad(f"scoring {self.scoring!r} is not one of {SCORINGS}")
        if not 1 <= self.top_k <= self.num_experts:
            bad(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.softmax_after_topk and (self.scoring != "softmax" or self.n_group > 1 or self.has_correction_bias):
            bad("softmax_after_topk (Mixtral) takes softmax scoring, no groups and no correction bias")
        if self.n_group > 1:
            if self.num_experts % self.n_group:
                bad(f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                bad(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            per_group = self.num_experts // self.n_group
            if self.top_k > self.topk_group * per_group:
                bad(f"top_k={self.top_k} exceeds the {self.topk_group * per_group} experts of the kept groups")
            if self.has_correction_bias and per_group < 2:
                bad("groups ranked by their top-2 biased scores need at least 2 experts per group")

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    @classmethod
    def from_hf_config(cls, config) -> "RoutingConfig":
        """The routing rules of a Hugging Face MoE config, by ``model_type``."""
        model_type = getattr(config, "model_type", None)
        builder = _FAMILIES.get(model_type)
        if builder is None:
            raise ValueError(f"no MoE routing rules for model_type {model_type!r}; known: {', '.join(sorted(_FAMILIES))}")
        return builder(config)


def _num_experts(config) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(config, name, None)
        if n:
            return int(n)
    raise ValueError(f"{type(config).__name__} names no expert count")


def _qwen_moe(config) -> RoutingConfig:
    # Qwen2-MoE / Qwen3-MoE: softmax over all experts, top-k, optional renormalisation.
    return RoutingConfig(num_experts=_num_experts(config), top_k=config.num_experts_per_tok, scoring="softmax",
                         renormalize=bool(getattr(config, "norm_topk_prob", False)))


def _mixtral(config) -> RoutingConfig:
    return RoutingConfig(num_experts=_num_experts(config), top_k=config.num_experts_per_tok, scoring="softmax",
                         softmax_after_topk=True)


def _noaux_tc(config) -> RoutingConfig:
    # GLM-4.5 (Glm4Moe) and DeepSeek-V3: sigmoid, correction bias, groups by top-2 biased sum.
    method = getattr(config, "topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ValueError(f"{config.model_type}: topk_method {method!r} is not supported (noaux_tc)")
    return RoutingConfig(num_experts=_num_experts(config), top_k=config.num_experts_per_tok, scoring="sigmoid",
                         n_group=int(getattr(config, "n_group", None) or 1),
                         topk_group=int(getattr(config, "topk_group", None) or 1),
                         renormalize=bool(getattr(config, "norm_topk_prob", True)),
                         routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
                         has_correction_bias=True)


def _deepseek_v2(config) -> RoutingConfig:
    method = getattr(config, "topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2: topk_method {method!r} is not supported")
    grouped = method == "group_limited_greedy"
    return RoutingConfig(num_experts=_num_experts(config), top_k=config.num_experts_per_tok, scoring="softmax",
                         n_group=int(config.n_group) if grouped else 1,
                         topk_group=int(config.topk_group) if grouped else 1,
                         renormalize=bool(getattr(config, "norm_topk_prob", False)),
                         routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0))


def _ernie4_5_moe(config) -> RoutingConfig:
    # ERNIE-4.5: softmax over all experts, chosen with the aux-free correction bias (moe_use_aux_free, on in
    # every released checkpoint), the chosen probabilities renormalised.
    return RoutingConfig(num_experts=_num_experts(config), top_k=config.num_experts_per_tok, scoring="softmax",
                         renormalize=True,
                         has_correction_bias=getattr(config, "moe_use_aux_free", True) is not False)


_FAMILIES = {
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "mixtral": _mixtral,
    "glm4_moe": _noaux_tc,
    "glm4_moe_lite": _noaux_tc,
    "deepseek_v3": _noaux_tc,
    "deepseek_v2": _deepseek_v2,
    "ernie4_5_moe": _ernie4_5_moe,
}


def select_experts(router_logits: torch.Tensor, cfg: RoutingConfig,
                   e_score_correction_bias: torch.Tensor | None = None,
                   per_expert_scale: torch.Tensor | None = None, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights fp32 [T, k], topk_ids int32 [T, k]), ids by descending choice.

    THE routing decision. It is the dispatch layer's op ``select_experts`` (its PyTorch reference in
    ``turnout/ops/reference/routing.py`` states the rules; Triton and vendor implementations are
    conformance-tested against it). ``ops``: the engine's op table; without one, the reference runs.
    """
    if router_logits.dim() != 2 or router_logits.shape[-1] != cfg.num_experts:
        raise ValueError(f"router_logits must be [T, {cfg.num_experts}], got {tuple(router_logits.shape)}")
    fn = ops.select_experts if ops is not None else _reference_select_experts()
    return fn(router_logits, cfg.top_k, cfg.scoring, cfg.softmax_after_topk, cfg.n_group, cfg.topk_group,
              cfg.renormalize, cfg.routed_scaling_factor, e_score_correction_bias, per_expert_scale)


def _reference_select_experts():
    """Without an engine's op table: the op's declared reference, looked up by name in the registry."""
    from turnout.ops import default_registry

    return default_registry().ops["select_experts"].reference
