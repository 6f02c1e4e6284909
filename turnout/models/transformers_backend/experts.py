"""MoE experts of a transformers model through turnout's ``moe_experts`` op, via transformers' experts interface.

transformers 5 (5.17 and later) stacks the routed experts of its MoE families in one module per layer
(``gate_up_proj`` [E, 2I, H], gate rows then up rows; ``down_proj`` [E, H, I]: ``moe_experts``' own layout)
whose class is decorated with ``use_experts_implementation``: its forward calls
``ALL_EXPERTS_FUNCTIONS[config._experts_implementation](module, hidden_states, top_k_index, top_k_weights)``.
The routing (top-k, normalisation, scaling) is computed before, by the family's own router; the experts get it
as given, which is turnout's routing contract. ``"turnout"`` is registered there (``register``) and chosen with
the public ``set_experts_implementation``; each experts module gets an ``ExpertsShard`` (``turnout_shard``) that
calls ``ops.moe_experts`` on this rank's part of the stacks and sums the ranks' partial outputs with one
``ops.all_reduce``, before the MoE block adds its shared expert (which the block computes whole).

Under tensor parallelism the stacks are split as turnout's native experts are (turnout/layers/moe/experts.py):
by the intermediate dim (rank r holds rows [r I/W, (r+1) I/W) of each expert's gate and of its up, back to back,
and those columns of its down), or with ``expert_parallel`` by expert id (rank r holds experts
[r E/W, (r+1) E/W); ids of another rank's experts become -1, which the op skips).

An experts class the op does not compute exactly stays transformers code, whole on every rank, with the reason
in the start-up line (``experts_reason``): one without a gate, with biases, transposed or interleaved stacks, a
norm after each expert, or a gated unit that is not SiLU(gate) * up (checked numerically on a random probe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from turnout.distributed.parallel_state import SINGLE, TPGroup

IMPLEMENTATION = "turnout"


def register() -> None:
    """Register ``turnout_experts`` under ``"turnout"`` with transformers' experts interface (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, turnout_experts)


def turnout_experts(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The function registered as ``"turnout"``: the module's ``ExpertsShard`` computes it."""
    shard = module.__dict__.get("turnout_shard")
    if shard is None:
        raise RuntimeError(f"the 'turnout' experts implementation runs only inside turnout's transformers backend "
                           f"({type(module).__name__} has no turnout shard)")
    return shard(module, hidden_states, top_k_index, top_k_weights)


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a stacked-experts module of transformers' experts interface (the decorator sets
    these attributes on every instance)."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated")) and \
        isinstance(getattr(module, "down_proj", None), nn.Parameter)


def _gate_is_silu_and_mul(module: nn.Module, inter: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    # [S, 2I] past any clamp a variant might apply; on the CPU whatever device context the model is built under
    x = torch.randn(3, 2 * inter, generator=gen, device="cpu") * 3.0
    try:
        with torch.no_grad():
            got = module._apply_gate(x)
    except Exception:  # noqa: BLE001 - a gate that wants more than a tensor is not SiLU-and-mul
        return False
    want = F.silu(x[:, :inter]) * x[:, inter:]
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-6,
                                                                                         atol=1e-6)


def experts_reason(module: nn.Module) -> str | None:
    """Why ``ops.moe_experts`` does not compute this experts module exactly; None when it does."""
    name = type(module).__name__
    if not module.has_gate:
        return f"{name} has no gate (an up projection and an activation)"
    if getattr(module, "has_bias", False):
        return f"{name} has biases"
    if module.is_transposed or not module.is_concatenated:
        return f"{name} stores its stacks {'transposed' if module.is_transposed else 'interleaved'}"
    if getattr(module, "has_post_expert_norm", False):
        return f"{name} norms each expert's output"
    gate_up, down = getattr(module, "gate_up_proj", None), module.down_proj
    if not isinstance(gate_up, nn.Parameter) or gate_up.dim() != 3 or down.dim() != 3 or \
            gate_up.shape[0] != down.shape[0] or gate_up.shape[1] != 2 * down.shape[2] or \
            gate_up.shape[2] != down.shape[1]:
        return f"{name}'s stacks are not [E, 2I, H] and [E, H, I]"
    if not _gate_is_silu_and_mul(module, down.shape[2]):
        return f"{name}'s gated unit is not SiLU(gate) * up"
    return None


class ExpertsShard:
    """This rank's part of one experts module: the split, the weight loaders of its two stacks, the forward.

    A plain object held in the module's ``__dict__`` (not a submodule: it owns no parameter; the stacks stay the
    module's own, under the checkpoint's names)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, ops, tp: TPGroup = SINGLE,
                 expert_parallel: bool = False):
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.ops, self.tp = ops, tp
        self.expert_parallel = expert_parallel and tp.size > 1
        if self.expert_parallel:
            if num_experts % tp.size:
                raise ValueError(f"enable_expert_parallel: num_experts {num_experts} is not divisible by "
                                 f"tensor_parallel_size {tp.size}")
            self.local_experts, self.local_inter = num_experts // tp.size, inter
            self.expert_start, self.inter_start = tp.rank * self.local_experts, 0
        else:
            if inter % tp.size:
                raise ValueError(f"moe intermediate size {inter} is not divisible by tensor-parallel size {tp.size}")
            self.local_experts, self.local_inter = num_experts, inter // tp.size
            self.expert_start, self.inter_start = 0, tp.rank * self.local_inter

    def describe(self) -> str:
        if self.expert_parallel:
            return f"experts {self.expert_start}+{self.local_experts} of ep {self.tp.size}"
        if self.tp.size > 1:
            return f"intermediate {self.inter_start}+{self.local_inter} of tp {self.tp.size}"
        return "whole"

    def make_parameters(self, module: nn.Module) -> None:
        """Replace the module's two (meta) stacks by this rank's, with their loaders."""
        el, il, h = self.local_experts, self.local_inter, self.hidden
        dtype = module.down_proj.dtype
        for name, shape in (("gate_up_proj", (el, 2 * il, h)), ("down_proj", (el, h, il))):
            p = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
            p.weight_loader = self._stacked_loader(name)
            p.load_expert = self._expert_loader(name)
            p.num_experts = self.num_experts  # the stack holds this rank's; checkpoint_names counts them all
            setattr(module, name, p)
        module.__dict__["turnout_shard"] = self

    def _place(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One expert's full tensor ``src`` ([2I, H] gate then up, or [H, I]) -> this rank's part ``dst``."""
        i0, il, inter = self.inter_start, self.local_inter, self.inter
        if name == "down_proj":
            dst.copy_(src.narrow(1, i0, il))
        else:
            dst.narrow(0, 0, il).copy_(src.narrow(0, i0, il))
            dst.narrow(0, il, il).copy_(src.narrow(0, inter + i0, il))

    def _full_shape(self, name: str) -> tuple[int, int]:
        return (2 * self.inter, self.hidden) if name == "gate_up_proj" else (self.hidden, self.inter)

    def _stacked_loader(self, name: str):
        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
            if shard_id is not None:
                raise ValueError(f"unexpected shard {shard_id!r} for the stacked experts {name}")
            if loaded.device.type != "meta" and loaded.data_ptr() == param.data_ptr() and \
                    loaded.shape == param.shape:
                return  # the stack itself, filled expert by expert (checkpoint_names.renamed)
            want = (self.num_experts, *self._full_shape(name))
            if tuple(loaded.shape) != want:
                raise ValueError(f"stacked experts {name}: checkpoint tensor {tuple(loaded.shape)}, expected {want}")
            for e in range(self.local_experts):
                self._place(name, param.data[e], loaded[self.expert_start + e])

        return load

    def _expert_loader(self, name: str):
        def load(param: torch.Tensor, loaded: torch.Tensor, expert: int, part: int, parts: int) -> None:
            """Expert ``expert``'s tensor ``part`` of ``parts`` (gate 0 and up 1 of 2, or the whole [2I, H] / [H, I])."""
            full = self._full_shape(name)
            rows = full[0] // parts
            want = (rows, full[1])
            if not 0 <= expert < self.num_experts or tuple(loaded.shape) != want:
                raise ValueError(f"expert {expert} part {part} of {parts} of {name}: checkpoint tensor "
                                 f"{tuple(loaded.shape)}, expected {want} for an expert in [0, {self.num_experts})")
            e = expert - self.expert_start
            if not 0 <= e < self.local_experts:
                return  # another rank's expert
            if parts == 1:
                self._place(name, param.data[e], loaded)
            else:  # gate (0) or up (1): this rank's rows of it, in the gate or the up half of the local stack
                il = self.local_inter
                param.data[e].narrow(0, part * il, il).copy_(loaded.narrow(0, self.inter_start, il))

        return load

    def __call__(self, module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """hidden [..., H] with transformers' routing -> the routed output [..., H], summed over the ranks."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        ids = top_k_index.reshape(x.shape[0], -1).to(torch.int32)  # [T, k]
        weights = top_k_weights.reshape(x.shape[0], -1).float()
        if self.expert_parallel:  # global ids -> this rank's; another rank's experts -> -1 (skipped by the op)
            local = ids - self.expert_start
            ids = torch.where((local >= 0) & (local < self.local_experts), local, -1)
        out = self.ops.moe_experts(x.contiguous(), module.gate_up_proj, module.down_proj, weights, ids)
        if self.tp.size > 1:
            out = self.ops.all_reduce(out, self.tp.group)
        return out.view(hidden_states.shape)


def route_experts(hf, ops, tp: TPGroup = SINGLE, expert_parallel: bool = False) -> tuple[int, str | None]:
    """Put every experts module of ``hf`` (parameters still on the meta device) on ``ops.moe_experts``:
    (how many, None), or (0, why not) when any of them cannot be (they all stay transformers code then: the
    implementation is one per config)."""
    modules = [m for m in hf.modules() if is_experts_module(m)]
    if not modules:
        return 0, None
    reasons = [r for r in (experts_reason(m) for m in modules) if r]
    if reasons:
        return 0, reasons[0]
    try:
        register()
        hf.set_experts_implementation(IMPLEMENTATION)
    except (ImportError, AttributeError, KeyError, ValueError) as e:  # this transformers has no such interface
        return 0, f"transformers' experts interface refused it ({type(e).__name__}: {e})"
    if any(getattr(m.config, "_experts_implementation", None) != IMPLEMENTATION for m in modules):
        return 0, "set_experts_implementation did not reach every experts module"
    for m in modules:
        e, h, i = m.down_proj.shape[0], m.down_proj.shape[1], m.down_proj.shape[2]
        ExpertsShard(e, h, i, ops, tp, expert_parallel).make_parameters(m)
    return len(modules), None
