"""Safetensors checkpoints: memory-mapped, streamed tensor by tensor, sharded or not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of an HF model directory, in a stable order.

    ``model.safetensors.index.json`` (sharded) wins; then ``model.safetensors``; then any
    ``*.safetensors``. Raises ValueError when there are none or the index names a missing shard.
    """
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [d / f for f in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shard(s) that are not there: {', '.join(missing)}")
        if files:
            return files
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
        hint = (f" (found {', '.join(others[:3])}: PyTorch pickles are not loaded; convert them to "
                f"safetensors)" if others else "")
        raise ValueError(f"no *.safetensors checkpoint in {d}{hint}")
    return files


def iter_safetensors(files: list[Path], device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file; each file is memory-mapped and read lazily, so
    at most one tensor at a time is materialised by the reader."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
