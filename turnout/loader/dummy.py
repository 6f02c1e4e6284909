"""Random weights for benchmarks: no checkpoint, deterministic from a seed, made on the device."""

from __future__ import annotations

import torch
from torch import nn

from turnout.layers.norm import RMSNorm


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) for matrices and embeddings, zeros for biases, ones for norm weights.

    The same seed gives the same weights on the same device type. Everything is drawn in place on
    the parameters' own device, so a multi-GB model initialises in milliseconds on a GPU.
    """
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
            p.normal_(0.0, std, generator=gen)
