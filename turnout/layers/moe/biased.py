"""A router with a bias and routed experts with biased projections and a declared activation (GPT-OSS), run
through ``ops.moe_experts_biased`` (turnout/ops/reference/moe_biased.py).

``BiasedExperts`` holds the stacks in the op's layout, as ``FusedExperts`` does: ``gate_up_proj`` [E, 2I, H] (each
expert's gate rows, then its up rows), ``gate_up_proj_bias`` [E, 2I] (the same order), ``down_proj`` [E, H, I],
``down_proj_bias`` [E, H]. The checkpoint keeps transformers' layout for GPT-OSS: ``gate_up_proj`` [E, H, 2I] and
its bias [E, 2I] with gate and up *interleaved* (column 2j is gate j, 2j + 1 up j), ``down_proj`` [E, I, H];
the loaders de-interleave and transpose into this rank's slice.

Tensor parallel (the default across ranks) splits each expert's intermediate dim as ``FusedExperts`` does; each
rank's output is a partial sum the block all-reduces, so the down bias, which is added once per (token, expert),
is added on rank 0 only. Expert parallel gives each rank whole experts, biases included.

fp8 experts (``plan.experts_quant``) have no kernel for the biases and the clamped unit: these experts stay in the
compute dtype (the fallback the op table would take), and the model says so once in the log.
"""

from __future__ import annotations

import torch
from torch import nn

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.linear import project
from turnout.layers.moe.experts import _check
from turnout.layers.moe.layer import Router
from turnout.layers.moe.router import RoutingConfig, select_experts
from turnout.layers.weights import default_weight_loader


class BiasedRouter(Router):
    """``Router`` whose logits carry a bias [E]: x W^T + b (GPT-OSS's ``mlp.router``)."""

    def __init__(self, hidden_size: int, routing: RoutingConfig, ops=None, plan: FusionPlan = NO_FUSIONS):
        super().__init__(hidden_size, routing, ops=ops, plan=plan)
        self.bias = nn.Parameter(torch.empty(routing.num_experts), requires_grad=False)
        self.bias.weight_loader = default_weight_loader

    def forward(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        logits = project(x, self.weight, self.bias, self.one_row_ops, self.takes_norm, self.linear_ops)  # [T, E]
        return select_experts(logits, self.routing, ops=self.ops)


class BiasedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops, *,
                 activation: str = "clamped_swiglu", alpha: float = 1.702, limit: float = 7.0,
                 tp: TPGroup = SINGLE, expert_parallel: bool = False):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.ops = ops
        self.activation, self.alpha, self.limit = activation, float(alpha), float(limit)
        self.tp = tp
        self.expert_parallel = expert_parallel and tp.size > 1
        if self.expert_parallel:
            if num_experts % tp.size:
                raise ValueError(f"enable_expert_parallel: num_experts {num_experts} is not divisible by "
                                 f"tensor_parallel_size {tp.size}")
            self.num_local_experts, self.local_intermediate = num_experts // tp.size, intermediate_size
            self.expert_start, self.inter_start = tp.rank * self.num_local_experts, 0
        else:
            if intermediate_size % tp.size:
                raise ValueError(f"moe intermediate size {intermediate_size} is not divisible by "
                                 f"tensor_parallel_size {tp.size}")
            self.num_local_experts, self.local_intermediate = num_experts, intermediate_size // tp.size
            self.expert_start, self.inter_start = 0, tp.rank * self.local_intermediate
        # the down bias joins each (token, expert) output once: on every rank that holds whole experts, on rank 0
        # of an intermediate split (the other ranks' partial sums must not add it again)
        self.adds_down_bias = self.expert_parallel or tp.rank == 0
        el, il = self.num_local_experts, self.local_intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(el, 2 * il, hidden_size), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(el, 2 * il), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(el, hidden_size, il), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(el, hidden_size), requires_grad=False)
        for p in (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias):
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's part of one stacked checkpoint tensor in transformers' GPT-OSS layout (module docstring)."""
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for stacked GPT-OSS experts")
        e, h, inter = self.num_experts, self.hidden_size, self.intermediate_size
        e0, el, i0, il = self.expert_start, self.num_local_experts, self.inter_start, self.local_intermediate
        mine = loaded.narrow(0, e0, el) if loaded.dim() and loaded.shape[0] == e else loaded
        if param is self.gate_up_proj:
            _check("experts.gate_up_proj", (e, h, 2 * inter), loaded)
            for half, (start, step) in enumerate(((0, 2), (1, 2))):  # gate: even columns, up: odd ones
                part = mine[:, :, start::step].transpose(1, 2).narrow(1, i0, il)  # [el, il, H]
                param.data.narrow(1, half * il, il).copy_(part)
        elif param is self.gate_up_proj_bias:
            _check("experts.gate_up_proj_bias", (e, 2 * inter), loaded)
            param.data.narrow(1, 0, il).copy_(mine[:, 0::2].narrow(1, i0, il))
            param.data.narrow(1, il, il).copy_(mine[:, 1::2].narrow(1, i0, il))
        elif param is self.down_proj:
            _check("experts.down_proj", (e, inter, h), loaded)
            param.data.copy_(mine.transpose(1, 2).narrow(2, i0, il))  # [el, H, il]
        else:
            _check("experts.down_proj_bias", (e, h), loaded)
            param.data.copy_(mine)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] with the routing as given -> this rank's partial sum [T, H] (the whole sum on one rank)."""
        if self.expert_parallel:  # global ids -> this rank's; another rank's experts -> -1 (skipped by the op)
            local = topk_ids - self.expert_start
            topk_ids = torch.where((local >= 0) & (local < self.num_local_experts), local, -1)
        return self.ops.moe_experts_biased(hidden, self.gate_up_proj, self.gate_up_proj_bias, self.down_proj,
                                           self.down_proj_bias if self.adds_down_bias else None, topk_weights,
                                           topk_ids, self.activation, self.alpha, self.limit)

    def extra_repr(self) -> str:
        split = ""
        if self.expert_parallel:
            split = f", experts {self.expert_start}+{self.num_local_experts} of ep {self.tp.size}"
        elif self.tp.size > 1:
            split = f", intermediate {self.inter_start}+{self.local_intermediate} of tp {self.tp.size}"
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"{self.activation}(alpha={self.alpha}, limit={self.limit}), biased{split}")
