"""The default per-parameter weight loader, shared by every layer (and the loaders' walker)."""

from __future__ import annotations

import torch


def check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch{' for ' + what if what else ''}: checkpoint tensor "
                         f"{tuple(loaded.shape)}, parameter expects {tuple(param.shape)}")


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Copy a whole tensor (any dtype/device) into ``param`` after checking the shape."""
    if shard_id is not None:
        raise ValueError(f"unexpected shard {shard_id!r} for an unpacked parameter")
    check_shape(param, loaded_weight)
    param.data.copy_(loaded_weight)
