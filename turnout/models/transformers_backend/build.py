"""Building a transformers model for turnout: parameters on the meta device, turnout's layers where a module
matches one, then the parameters made real on the engine's device.

- ``parameters_on_meta``: while transformers' ``from_config`` runs, every parameter a module registers goes to
  the meta device (no memory, no random init), while buffers (rotary frequencies, position tables) are computed
  on the real device as the modeling code makes them: they come from the config, not the checkpoint.
- ``replace_linears``: every ``nn.Linear`` of the base model becomes a turnout linear layer (the op table's
  projections, fp8 quantisation, tensor parallelism): column- or row-parallel where the config's
  ``base_model_tp_plan`` says ``colwise`` / ``rowwise``, whole on every rank otherwise (experts, routers and the
  layers a plan gathers again stay whole: each rank computes them in full).
- ``replace_norms``: an RMSNorm class whose output equals turnout's ``rms_norm`` op (weight w or 1 + w) on a
  random probe becomes ``turnout.layers.norm.RMSNorm``; the check is numerical, so a norm that computes
  anything else stays transformers code.
- ``materialize``: every meta parameter gets real storage on the device (tied parameters stay one tensor).
"""

from __future__ import annotations

import contextlib
import copy
import re

import torch
from torch import nn

from turnout.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from turnout.layers.norm import RMSNorm

SHARDED_STYLES = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}
# Styles whose layer's output is whole on every rank (a column split gathered again, a row split of a whole input
# reduced again): the same values as the whole layer on every rank, which is what they become here.
WHOLE_STYLES = ("colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce")


@contextlib.contextmanager
def parameters_on_meta():
    """Within: a parameter registered by any module is moved to the meta device as it is registered."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _plan_patterns(tp_plan: dict | None) -> list[tuple[re.Pattern, str]]:
    return [(re.compile("^" + re.escape(k).replace(r"\*", r"\d+") + "$"), v) for k, v in (tp_plan or {}).items()]


def replace_linears(base: nn.Module, ops, plan, tp, tp_plan: dict | None) -> dict[str, int]:
    """Every ``nn.Linear`` under ``base`` -> a turnout linear (see the module docstring). Returns how many of each
    kind were made. With tp > 1 a plan style other than colwise / rowwise on a linear layer is refused, since
    its neighbours' split would not match."""
    patterns = _plan_patterns(tp_plan)
    made: dict[str, int] = {}
    for name, module in list(base.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            full = f"{name}.{child_name}" if name else child_name
            style = next((s for p, s in patterns if p.match(full)), None)
            if tp.size > 1 and style is not None and style not in SHARDED_STYLES and style not in WHOLE_STYLES:
                raise ValueError(f"tensor_parallel_size {tp.size}: {full} has tensor-parallel style {style!r} in the "
                                 "config's base_model_tp_plan; the transformers backend splits colwise / rowwise "
                                 f"layers and keeps {', '.join(WHOLE_STYLES)} whole")
            cls = SHARDED_STYLES.get(style, ReplicatedLinear) if tp.size > 1 else ColumnParallelLinear
            layer = cls(child.in_features, child.out_features, child.bias is not None, tp=tp, ops=ops, plan=plan)
            layer.in_features, layer.out_features = child.in_features, child.out_features  # read by some modules
            module.add_module(child_name, layer)  # same name: the checkpoint's tensor names hold
            made[cls.__name__] = made.get(cls.__name__, 0) + 1
    return made


def _eps_of(module: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return None


def _norm_kind(module: nn.Module) -> bool | None:
    """Whether ``module`` computes rms_norm with w (False) or with 1 + w (True), checked on a random float32
    probe on the CPU; None when it is neither (or cannot be probed)."""
    weight = module._parameters.get("weight")
    eps = _eps_of(module)
    if eps is None or weight is None or weight.dim() != 1 or len(module._parameters) != 1 or list(module.buffers()) \
            or list(module.children()):
        return None
    probe = copy.deepcopy(module).to_empty(device="cpu").float()
    gen = torch.Generator().manual_seed(0)
    h = weight.shape[0]
    with torch.no_grad():
        # device="cpu" explicitly: the model is built under a device context (torch.device("cuda")), which would
        # put a bare randn on the GPU with this CPU generator
        probe.weight.copy_(torch.randn(h, generator=gen, device="cpu"))
        x = torch.randn(2, 3, h, generator=gen, device="cpu")
        try:
            got = probe(x)
        except Exception:  # noqa: BLE001 - a norm that wants more than a tensor is not one of ours
            return None
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        for unit_offset in (False, True):
            w = probe.weight + 1.0 if unit_offset else probe.weight
            if isinstance(got, torch.Tensor) and got.shape == x.shape and torch.allclose(got, normed * w, atol=1e-5,
                                                                                         rtol=1e-5):
                return unit_offset
    return None


def replace_norms(base: nn.Module, ops) -> int:
    """RMSNorm modules equal to turnout's op -> ``turnout.layers.norm.RMSNorm`` (see the module docstring)."""
    kinds: dict[tuple, bool | None] = {}
    n = 0
    for module in list(base.modules()):
        for child_name, child in list(module.named_children()):
            if "RMSNorm" not in type(child).__name__:
                continue
            key = (type(child), _eps_of(child))
            if key not in kinds:
                kinds[key] = _norm_kind(child)
            if kinds[key] is None:
                continue
            norm = RMSNorm(child.weight.shape[0], _eps_of(child), ops, unit_offset=kinds[key])
            module.add_module(child_name, norm)
            n += 1
    return n


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter zeroed storage on ``device`` (the dtype transformers made it in), one tensor per
    parameter however many modules hold it, keeping each parameter's attributes (weight loaders)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in made:
                real = torch.zeros(p.shape, dtype=p.dtype, device=device)
                new = nn.Parameter(real, requires_grad=False)
                new.__dict__.update(p.__dict__)
                made[id(p)] = new
            module._parameters[name] = made[id(p)]
