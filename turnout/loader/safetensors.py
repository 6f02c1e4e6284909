"""Safetensors checkpoints: memory-mapped, streamed tensor by tensor, sharded or not."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Iterator

import torch

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of an HF model directory, in a stable order.

    ``model.safetensors.index.json`` (sharded) wins; then ``model.safetensors``; then any
    ``*.safetensors``. Raises ValueError naming the file when there are none, the index is not the JSON
    an index is, or it names a missing shard or a path outside the directory.
    """
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.is_file():
        files = [d / f for f in _index_shards(index)]
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


def _index_shards(index: Path) -> list[str]:
    """The shard file names an index maps tensors to, each a plain relative path inside the index's
    directory. The check is on the names as written, not on resolved paths: a shard that is a symlink
    out of the directory (the Hugging Face cache's snapshots point into its blobs/) is the directory
    owner's choice, while ``../`` or an absolute path in a file that came with the checkpoint is not."""
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map") or {}
    except (ValueError, AttributeError) as e:  # not JSON, not UTF-8, or not an object
        raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map must map tensor names to shard files")
    for name, shard in weight_map.items():
        parts = PurePosixPath(shard).parts if isinstance(shard, str) else ()
        if not parts or shard.startswith("/") or "\\" in shard or ".." in parts or ":" in parts[0]:
            raise ValueError(f"{index}: tensor {name!r} is mapped to {shard!r}, which is not a file inside "
                             f"the checkpoint directory")
    return sorted(set(weight_map.values()))


def iter_safetensors(files: list[Path], device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file; each file is memory-mapped and read lazily, so
    at most one tensor at a time is materialised by the reader."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def safetensors_headers(path: Path) -> list[tuple[str, torch.Tensor]]:
    """(name, meta tensor of the stored shape and dtype) for every tensor of one file, from its header only
    (no tensor data read)."""
    from safetensors import safe_open

    out = []
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            dtype = _ST_DTYPES.get(sl.get_dtype(), torch.uint8)  # unknown: an integer, refused by the check
            out.append((name, torch.empty(sl.get_shape(), dtype=dtype, device="meta")))
    return out


def checked_headers(path: Path) -> list[tuple[str, torch.Tensor]]:
    """``safetensors_headers`` of a file checked whole first (its size against its header, loader/checks.py),
    so that nothing can fail half-way through reading it later; every error a ValueError naming the file."""
    from turnout.loader.checks import check_safetensors

    try:
        check_safetensors(path)
        return safetensors_headers(path)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - OSError, the safetensors reader's own errors: the file is bad
        raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
