"""Stacked routed-expert parameters, run through ``ops.moe_experts``.

``gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and ``down_proj`` [E, H, I]: the
layout the ``moe_experts`` op takes and the one transformers 5 keeps in memory, so a checkpoint that
already stores stacked tensors loads as is. Per-expert checkpoint tensors (``experts.{e}.gate_proj``,
Mixtral's ``experts.{e}.w1``) load into their slice through ``weight_loader`` with shard id
``(expert_id, "gate" | "up" | "down")``; the model's ``weight_name_rules`` produce those ids.

Across the ranks of a tensor-parallel group (``tp``) the experts are split one of two ways, and each loader
takes this rank's slice of a full checkpoint tensor, per-expert or stacked:

- tensor parallel (the default): every rank holds every expert, split by the intermediate dim like a dense
  MLP: rank r holds rows [r I/W, (r+1) I/W) of each expert's gate and of its up (back to back, so the op's
  gate-then-up layout holds locally) and those columns of its down;
- expert parallel (``expert_parallel``): rank r holds the whole experts [r E/W, (r+1) E/W). The routing
  (made once, identically on every rank) is kept as is; ids of another rank's experts become -1, which the
  op skips.

Either way ``forward`` returns this rank's partial sum of the routed output; the MoE block sums over the
ranks with one ``all_reduce`` (with the shared expert's partial sum folded in).

Quantised (``quant``: the plan's ``experts_quant``) the method creates the parameters and runs the forward: fp8
(turnout/quant/moe_fp8.py) the two stacks in fp8 with their block scales ``gate_up_proj_scale_inv`` /
``down_proj_scale_inv`` (per-expert checkpoint scales map there through ``expert_weight_rules``) through
``ops.moe_experts_fp8``; 4-bit (turnout/quant/moe_w4.py) packed stacks named after the checkpoint's suffixes
(``gate_up_proj_qweight``, ...) through ``ops.moe_experts_w4a16``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.linear import _split

EXPERT_SHARDS = ("gate", "up", "down")
# a 4-bit checkpoint's per-expert tensors besides weight_scale (AWQ / GPTQ; compressed-tensors pack-quantized)
W4_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_zero_point", "weight_g_idx",
               "weight_shape")


def _check(what: str, want: tuple, loaded: torch.Tensor) -> None:
    if tuple(loaded.shape) != tuple(want):
        raise ValueError(f"shape mismatch for {what}: checkpoint tensor {tuple(loaded.shape)}, "
                         f"parameter expects {tuple(want)}")


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops, *, tp: TPGroup = SINGLE,
                 expert_parallel: bool = False, quant=None):
        super().__init__()
        self.num_experts = num_experts  # all of them: the routing's E
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size  # full, per expert
        self.ops = ops
        self.tp = tp
        self.expert_parallel = expert_parallel and tp.size > 1
        if self.expert_parallel:
            if num_experts % tp.size:
                raise ValueError(f"enable_expert_parallel: num_experts {num_experts} is not divisible by "
                                 f"tensor_parallel_size {tp.size}")
            self.num_local_experts, self.local_intermediate = num_experts // tp.size, intermediate_size
            self.expert_start, self.inter_start = tp.rank * self.num_local_experts, 0
        else:
            self.num_local_experts = num_experts
            self.local_intermediate = _split(intermediate_size, tp.size, "moe intermediate size")
            self.expert_start, self.inter_start = 0, tp.rank * self.local_intermediate
        el, il = self.num_local_experts, self.local_intermediate
        self.quant = quant
        if quant is not None:  # fp8 stacks and their block scales, its own loaders (turnout/quant/moe_fp8.py)
            quant.create_weights(self, ops)
        else:
            # [E_local, 2 I_local, H] and [E_local, H, I_local]; filled by the weight loaders.
            self.gate_up_proj = nn.Parameter(torch.empty(el, 2 * il, hidden_size), requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(el, hidden_size, il), requires_grad=False)
            self.gate_up_proj.weight_loader = self.weight_loader
            self.down_proj.weight_loader = self.weight_loader
        # The walker counts a parameter loaded once every shard id listed here was seen: this rank's experts.
        # (4-bit experts hold no gate_up_proj / down_proj but packed stacks, which their method marks itself.)
        for name, shards in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            if isinstance(getattr(self, name, None), nn.Parameter):
                getattr(self, name).shard_ids = self.shard_ids(shards)

    def shard_ids(self, shards: tuple[str, ...]) -> tuple:
        """The (expert id, shard) pairs of this rank's experts: what a stacked parameter's loaders must see."""
        return tuple((e, s) for e in range(self.expert_start, self.expert_start + self.num_local_experts)
                     for s in shards)

    def rank_slice(self, loaded: torch.Tensor, expert_id, shard: str):
        """(local expert index, this rank's part of one full per-expert checkpoint tensor: rows [I_local, H] of a gate
        or up, columns [H, I_local] of a down), or None for an expert another rank holds."""
        e = int(expert_id)
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range [0, {self.num_experts})")
        down = shard == "down"
        _check(f"expert {e} {shard}", (self.hidden_size, self.intermediate_size) if down
               else (self.intermediate_size, self.hidden_size), loaded)
        if not self.expert_start <= e < self.expert_start + self.num_local_experts:
            return None
        return e - self.expert_start, loaded.narrow(1 if down else 0, self.inter_start, self.local_intermediate)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id=None, shard: str | None = None):
        """Copy this rank's slice of one full checkpoint tensor into the stack.

        ``weight_loader(param, t, expert_id, shard)``, or ``weight_loader(param, t, (expert_id, shard))`` as the
        generic weight-map walker calls it; no expert id: ``t`` is the whole stacked tensor ([E, 2I, H] or
        [E, H, I]). An expert another rank holds (expert parallel) is skipped.
        """
        if isinstance(expert_id, tuple):
            expert_id, shard = expert_id
        e0, el, i0, il = self.expert_start, self.num_local_experts, self.inter_start, self.local_intermediate
        inter, hidden = self.intermediate_size, self.hidden_size
        if expert_id is None:
            gate_up = param is self.gate_up_proj
            _check("the stacked experts", (self.num_experts, 2 * inter, hidden) if gate_up
                   else (self.num_experts, hidden, inter), loaded)
            mine = loaded.narrow(0, e0, el)
            if gate_up:  # this rank's gate rows, then its up rows
                param.data.narrow(1, 0, il).copy_(mine.narrow(1, i0, il))
                param.data.narrow(1, il, il).copy_(mine.narrow(1, inter + i0, il))
            else:
                param.data.copy_(mine.narrow(2, i0, il))
            return
        if not ((param is self.gate_up_proj and shard in ("gate", "up"))
                or (param is self.down_proj and shard == "down")):
            raise ValueError(f"shard {shard!r} does not belong in this parameter {tuple(param.shape)}")
        placed = self.rank_slice(loaded, expert_id, shard)
        if placed is None:  # another rank's expert
            return
        e, part = placed
        if shard == "down":
            param.data[e].copy_(part)
        else:
            param.data[e].narrow(0, 0 if shard == "gate" else il, il).copy_(part)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] with the routing as given -> this rank's partial sum [T, H] (the whole sum on one rank)."""
        if self.expert_parallel:  # global ids -> this rank's; another rank's experts -> -1 (skipped by the op)
            local = topk_ids - self.expert_start
            topk_ids = torch.where((local >= 0) & (local < self.num_local_experts), local, -1)
        if self.quant is not None:
            return self.quant.apply(self, hidden, topk_weights, topk_ids)
        return self.ops.moe_experts(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        split = ""
        if self.expert_parallel:
            split = f", experts {self.expert_start}+{self.num_local_experts} of ep {self.tp.size}"
        elif self.tp.size > 1:
            split = f", intermediate {self.inter_start}+{self.local_intermediate} of tp {self.tp.size}"
        quant = f", {self.quant.describe()}" if self.quant is not None else ""
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"
                f"{split}{quant}")


def expert_weight_rules(module: str = r"mlp\.experts", target: str = "mlp.experts",
                        names: dict[str, str] | None = None) -> list:
    """``weight_name_rules`` entries mapping per-expert checkpoint tensors into the stacked parameters.

    ``names`` maps checkpoint projection names to shards (default HF ``gate_proj``/``up_proj``/
    ``down_proj``; Mixtral: ``w1``/``w3``/``w2``). ``module`` is the checkpoint's regex for the experts
    module, ``target`` our module path. An fp8 checkpoint's per-expert block scales (``.weight_scale_inv``;
    compressed-tensors: ``.weight_scale``) go to the stacks' ``*_scale_inv``, which only a quantised layer has; a
    4-bit checkpoint's (``.qweight``, ``.qzeros``, ``.scales``, ``.g_idx``; compressed-tensors ``.weight_packed``,
    ``.weight_zero_point``, ``.weight_g_idx``, ``.weight_shape``, and ``.weight_scale`` as above) to
    ``{stack}_{suffix}`` (turnout/quant/moe_w4.py).
    """
    names = names or {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    rules = []
    for ckpt_name, shard in names.items():
        param = "down_proj" if shard == "down" else "gate_up_proj"
        for suffix, ours in (("weight", param), ("weight_scale_inv", param + "_scale_inv"),
                             ("weight_scale", param + "_scale_inv"),
                             *((s, f"{param}_{s}") for s in W4_SUFFIXES)):
            rules.append((rf"(^|\.){module}\.(\d+)\.{re.escape(ckpt_name)}\.{suffix}$", rf"\g<1>{target}.{ours}",
                          lambda m, shard=shard: (int(m.group(2)), shard)))
    return rules
