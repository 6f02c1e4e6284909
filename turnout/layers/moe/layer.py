"""The sparse MoE block: router -> select_experts -> ops.moe_experts, plus shared experts and latents.

Data flow for hidden x [T, H]::

    logits = gate(x)                                  # [T, E], the gate sees the full hidden state
    weights, ids = select_experts(logits, routing, e_score_correction_bias, per_expert_scale)
    h = fc1_latent_proj(x)        (if latent)         # [T, L]
    y = ops.moe_experts(h, gate_up_proj, down_proj, weights, ids)
    y = fc2_latent_proj(y)        (if latent)         # back to [T, H] before the shared expert is added
    y += shared_experts(x)        (plain, GLM / DeepSeek)
    y += sigmoid(shared_expert_gate(x)) * shared_expert(x)   (Qwen2-MoE)

Routing happens here, once; the experts op receives it and never recomputes it.

Under tensor parallelism (``tp``) the router and the latent projections are replicated (every rank routes the
same tokens identically), the shared expert is a TP dense MLP and the routed experts are split by the
intermediate dim or, with ``expert_parallel``, by expert id (turnout/layers/moe/experts.py). Each rank's
routed and shared outputs are partial sums, added, then summed over the ranks with one ``ops.all_reduce``
(the shared gate is a per-token scalar, so it scales the partial sums as it would the whole).
"""

from __future__ import annotations

import torch
from torch import nn

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.activation import SiluAndMul
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    all_rows_path,
    one_row_path,
    project,
)
from turnout.layers.moe.experts import FusedExperts
from turnout.layers.moe.router import RoutingConfig, select_experts
from turnout.layers.norm import resolve
from turnout.layers.weights import default_weight_loader


def _per_expert_vector_loader(param, loaded, shard_id=None) -> None:
    """[E]; also [1, E], as ERNIE-4.5 stores its correction bias (one row per expert group, and one group)."""
    if loaded.dim() == 2 and loaded.shape[0] == 1:
        loaded = loaded[0]
    default_weight_loader(param, loaded, shard_id)


class Router(nn.Module):
    """``weight`` [E, H]; optional ``e_score_correction_bias`` [E] and ``per_expert_scale`` [E] (float32).
    ``plan``: one-row logits through ``ops.small_m_linear`` and, for a bf16/fp16 gate, the layer's pending
    pre-norm computed inside that projection where the plan fuses it for [E, H]."""

    def __init__(self, hidden_size: int, routing: RoutingConfig, logits_fp32: bool = False, ops=None,
                 plan: FusionPlan = NO_FUSIONS):
        super().__init__()
        self.routing = routing
        self.ops = ops
        self.logits_fp32 = logits_fp32
        e = routing.num_experts
        # A float32 gate (DeepSeek-V3 / GLM-4.5) keeps the choice among near-equal sigmoid scores stable.
        self.weight = nn.Parameter(torch.empty(e, hidden_size, dtype=torch.float32 if logits_fp32 else None),
                                   requires_grad=False)
        for name, wanted in (("e_score_correction_bias", routing.has_correction_bias),
                             ("per_expert_scale", routing.has_per_expert_scale)):
            if wanted:
                setattr(self, name, nn.Parameter(torch.empty(e, dtype=torch.float32), requires_grad=False))
                getattr(self, name).weight_loader = _per_expert_vector_loader
            else:
                setattr(self, name, None)
        self.weight.weight_loader = default_weight_loader
        self.one_row_ops, takes_norm = one_row_path(ops, plan, e, hidden_size)
        # A float32 gate projects the normed row in float32: it takes the tensor, never the pending norm.
        self.takes_norm = takes_norm and not logits_fp32
        self.linear_ops = all_rows_path(ops, plan)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights fp32 [T, k], topk_ids int32 [T, k])."""
        if self.logits_fp32:
            x = resolve(x)
            logits = project(x.float(), self.weight.float(), None, self.one_row_ops,
                             linear_ops=self.linear_ops)  # [T, E]
        else:
            logits = project(x, self.weight, None, self.one_row_ops, self.takes_norm, self.linear_ops)
        return select_experts(logits, self.routing, self.e_score_correction_bias, self.per_expert_scale,
                              ops=self.ops)


class SharedExpertMLP(nn.Module):
    """A dense SwiGLU expert every token goes through (HF names: gate_proj/up_proj packed, down_proj).
    Under TP its intermediate dim is split and its output is this rank's partial sum: the block reduces."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops, plan: FusionPlan = NO_FUSIONS,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size],
                                                       tp=tp, ops=ops, plan=plan)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, tp=tp, ops=ops, plan=plan,
                                           reduce_results=False)
        self.act_fn = SiluAndMul(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """``forward(hidden [T, H]) -> [T, H]``; parameters named as HF names them under ``mlp``.

    ``shared_intermediate_size`` > 0 adds a shared expert under ``shared_name`` (``shared_experts`` for
    GLM / DeepSeek, ``shared_expert`` for Qwen2-MoE); ``shared_gated`` adds Qwen2-MoE's scalar sigmoid gate
    ``shared_expert_gate`` [1, H]. ``latent_size`` runs the routed experts in a smaller space between
    ``fc1_latent_proj`` [L, H] and ``fc2_latent_proj`` [H, L].
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, routing: RoutingConfig, ops, *,
                 shared_intermediate_size: int = 0, shared_gated: bool = False,
                 shared_name: str = "shared_experts", latent_size: int | None = None,
                 router_logits_fp32: bool = False, plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE,
                 expert_parallel: bool = False, gate: nn.Module | None = None, experts: nn.Module | None = None):
        super().__init__()
        self.routing = routing
        # gate / experts: a family's own router or routed experts (GPT-OSS: biased, clamped SwiGLU), built by it
        self.gate = gate if gate is not None else Router(hidden_size, routing, logits_fp32=router_logits_fp32,
                                                         ops=ops, plan=plan)
        # a list the model runner hands every block for one forward whose routing a request returns
        # (turnout/worker/routed_experts.py); None otherwise, so other steps record nothing
        self.record_routing: list | None = None
        expert_dim = latent_size or hidden_size
        self.latent = latent_size is not None and latent_size != hidden_size
        if self.latent:
            self.fc1_latent_proj = ReplicatedLinear(hidden_size, latent_size, bias=False, ops=ops, plan=plan)
            self.fc2_latent_proj = ReplicatedLinear(latent_size, hidden_size, bias=False, ops=ops, plan=plan)
        self.experts = experts if experts is not None else FusedExperts(
            routing.num_experts, expert_dim, moe_intermediate_size, ops, tp=tp, expert_parallel=expert_parallel,
            quant=plan.experts_quant)
        self.shared_name = shared_name if shared_intermediate_size else None
        if shared_intermediate_size:
            self.add_module(shared_name, SharedExpertMLP(hidden_size, shared_intermediate_size, ops, plan, tp))
            self.shared_expert_gate = (ReplicatedLinear(hidden_size, 1, bias=False, ops=ops, plan=plan)
                                       if shared_gated else None)
        self.tp = tp
        self.reduce_ops = ops if tp.size > 1 else None  # decided once: a world of one makes no collective call

    takes_pending_norm = True  # the router's projection may compute the layer's pre-norm (PendingNorm)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden)  # the only routing decision
        if self.record_routing is not None:
            self.record_routing.append(topk_ids)
        hidden = resolve(hidden)  # [T, H]
        routed_in = self.fc1_latent_proj(hidden) if self.latent else hidden  # [T, L] or [T, H]
        out = self.experts(routed_in, topk_weights, topk_ids)
        if self.latent:
            out = self.fc2_latent_proj(out)  # [T, H]
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        if self.reduce_ops is not None:
            out = self.reduce_ops.all_reduce(out, self.tp.group)  # [T, H]: the ranks' partial sums, in place
        return out


def is_moe_layer(config, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` of an HF MoE config has routed experts.

    Dense layers: ``mlp_only_layers`` (Qwen), the first ``first_k_dense_replace`` (GLM-4.5, DeepSeek),
    and those off the sparse step: Qwen's ``(i + 1) % decoder_sparse_step``, DeepSeek's ``i % moe_layer_freq``.
    """
    if layer_idx in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    if layer_idx < (getattr(config, "first_k_dense_replace", None) or 0):
        return False
    step = getattr(config, "decoder_sparse_step", None)
    if step and (layer_idx + 1) % step:
        return False
    freq = getattr(config, "moe_layer_freq", None)
    return not (freq and layer_idx % freq)
