"""Random weights for benchmarks: no checkpoint, deterministic from a seed, made on the device.

The weights are those of the whole model whatever the tensor-parallel size: each parameter is drawn at its
full (unsharded) shape, in the same order and from the same generator on every rank, and this rank's slice
is loaded through the layers' own weight loaders, the way a checkpoint tensor is. So dummy TP=2 logits equal
dummy TP=1 logits (benchmarks/tp_check.py compares the two on a GPU), and expert-parallel ranks hold the same experts a
TP=1 model does.
"""

from __future__ import annotations

import torch
from torch import nn

from turnout.layers.norm import RMSNorm
from turnout.layers.weights import default_weight_loader


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) for matrices and embeddings, zeros for biases, ones for norm weights.

    The same seed gives the same weights on the same device type, for every tensor-parallel size. Everything
    is drawn on the parameters' own device, one full tensor at a time, so a multi-GB model initialises in
    milliseconds on a GPU. One rank (the model is whole) draws into the parameters in place.
    """
    full = _full_model(model)
    full_params = dict(full.named_parameters()) if full is not model else None
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if id(p) in norm_params:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            gen = generators.get(p.device)
            if gen is None:
                gen = generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            if getattr(p, "dummy_init", None) is not None:  # fp8 weights and their scales (turnout/quant/fp8.py)
                p.dummy_init(p, gen, std)
                continue
            if full_params is None:
                p.normal_(0.0, std, generator=gen)
                continue
            shape = full_params[name].shape
            drawn = torch.empty(shape, dtype=p.dtype, device=p.device).normal_(0.0, std, generator=gen)
            _load_slice(full, name, p, drawn)
            del drawn


def _full_model(model: nn.Module) -> nn.Module:
    """``model`` itself when it is whole; for a rank's shard, the same model unsharded on the meta device
    (shapes only, no memory), whose parameters give the full shapes and the packed layers' part offsets."""
    tp = getattr(model, "tp", None)
    if tp is None or tp.size == 1:
        return model
    with torch.device("meta"):
        return type(model)(model.config, model.ops, model.plan)


def _load_slice(full: nn.Module, name: str, param: nn.Parameter, drawn: torch.Tensor) -> None:
    """Load this rank's part of the full tensor ``drawn`` into ``param`` through its weight loader. A packed
    projection (q/k/v, gate/up) takes each part as the checkpoint tensor of its own it is stored as."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    owner = full.get_submodule(name.rpartition(".")[0])
    offsets = getattr(owner, "shard_offsets", None)  # the full model's: shard id -> (row offset, rows)
    if offsets and getattr(param, "shard_ids", None):
        for sid in param.shard_ids:
            off, rows = offsets[sid]
            loader(param, drawn.narrow(0, off, rows), sid)
    else:
        loader(param, drawn)
