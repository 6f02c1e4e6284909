"""Stacked routed-expert parameters, run through ``ops.moe_experts``.

``gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and ``down_proj`` [E, H, I]: the
layout the ``moe_experts`` op takes and the one transformers 5 keeps in memory, so a checkpoint that
already stores stacked tensors loads as is. Per-expert checkpoint tensors (``experts.{e}.gate_proj``,
Mixtral's ``experts.{e}.w1``) load into their slice through ``weight_loader`` with shard id
``(expert_id, "gate" | "up" | "down")``; the model's ``weight_name_rules`` produce those ids.
"""

from __future__ import annotations

import re

import torch
from torch import nn

EXPERT_SHARDS = ("gate", "up", "down")


def _check(what: str, want: tuple, loaded: torch.Tensor) -> None:
    if tuple(loaded.shape) != tuple(want):
        raise ValueError(f"shape mismatch for {what}: checkpoint tensor {tuple(loaded.shape)}, "
                         f"parameter expects {tuple(want)}")


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.ops = ops
        # [E, 2I, H] and [E, H, I]; filled by the weight loaders.
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                                      requires_grad=False)
        # The walker counts a parameter loaded once every shard id listed here was seen.
        self.gate_up_proj.shard_ids = tuple((e, s) for e in range(num_experts) for s in ("gate", "up"))
        self.down_proj.shard_ids = tuple((e, "down") for e in range(num_experts))
        self.gate_up_proj.weight_loader = self.weight_loader
        self.down_proj.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id=None, shard: str | None = None):
        """Copy one checkpoint tensor into the stack.

        ``weight_loader(param, t, expert_id, shard)``, or ``weight_loader(param, t, (expert_id, shard))`` as the
        generic weight-map walker calls it; no expert id: ``t`` is the whole stacked tensor.
        """
        if isinstance(expert_id, tuple):
            expert_id, shard = expert_id
        if expert_id is None:
            _check("the stacked experts", tuple(param.shape), loaded)
            param.data.copy_(loaded)
            return
        if not 0 <= int(expert_id) < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range [0, {self.num_experts})")
        e, inter, hidden = int(expert_id), self.intermediate_size, self.hidden_size
        if param is self.gate_up_proj and shard in ("gate", "up"):
            _check(f"expert {e} {shard}", (inter, hidden), loaded)
            param.data[e].narrow(0, 0 if shard == "gate" else inter, inter).copy_(loaded)
        elif param is self.down_proj and shard == "down":
            _check(f"expert {e} down", (hidden, inter), loaded)
            param.data[e].copy_(loaded)
        else:
            raise ValueError(f"shard {shard!r} does not belong in this parameter {tuple(param.shape)}")

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] with the routing as given -> [T, H]."""
        return self.ops.moe_experts(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"


def expert_weight_rules(module: str = r"mlp\.experts", target: str = "mlp.experts",
                        names: dict[str, str] | None = None) -> list:
    """``weight_name_rules`` entries mapping per-expert checkpoint tensors into the stacked parameters.

    ``names`` maps checkpoint projection names to shards (default HF ``gate_proj``/``up_proj``/
    ``down_proj``; Mixtral: ``w1``/``w3``/``w2``). ``module`` is the checkpoint's regex for the experts
    module, ``target`` our module path.
    """
    names = names or {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    rules = []
    for ckpt_name, shard in names.items():
        param = "down_proj" if shard == "down" else "gate_up_proj"
        rules.append((rf"(^|\.){module}\.(\d+)\.{re.escape(ckpt_name)}\.weight$", rf"\g<1>{target}.{param}",
                      lambda m, shard=shard: (int(m.group(2)), shard)))
    return rules
