"""Checkpoint files checked before they are read: an empty or cut-off file is named with the bytes it lacks.

An interrupted download is the usual cause. Left to the readers, a truncated GGUF fails deep inside numpy
("cannot reshape array of size ...") and a truncated safetensors file inside Rust; here each file's header
says how long the file must be, and the error says ``<file>: truncated: expected N bytes, file has M``.
Both walks read only the headers (no tensor data), so they cost milliseconds.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32


def _size(path: Path) -> int:
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path}: empty file (0 bytes); re-download or re-convert it")
    return size


def _truncated(path: Path, expected: int, size: int, at_least: bool = False) -> ValueError:
    return ValueError(f"{path}: truncated: expected {'at least ' if at_least else ''}{expected} bytes, "
                      f"file has {size} (an interrupted download or copy?)")


def check_safetensors(path: str | Path) -> int:
    """Raise ValueError if ``path`` is empty, cut off or has an unreadable header; else its tensor count.

    Layout: an 8-byte little-endian header length N, N bytes of JSON (name -> dtype, shape,
    data_offsets [begin, end) relative to the end of the header), then the data.
    """
    path = Path(path)
    size = _size(path)
    if size < 8:
        raise _truncated(path, 8, size, at_least=True)
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise _truncated(path, 8 + header_len, size, at_least=True)
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise ValueError(f"{path}: not a safetensors file (a tensor entry has no data_offsets)") from None
    if 8 + header_len + end > size:
        raise _truncated(path, 8 + header_len + end, size)
    return len(tensors)


class _Cursor:
    """Little-endian reads over a GGUF header; running off the end is a truncation error."""

    def __init__(self, path: Path, data, size: int):
        self.path, self.data, self.size, self.pos = path, data, size, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _truncated(self.path, self.pos + n, self.size, at_least=True)
        out = self.data[self.pos: self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> bytes:
        return self.take(self.u64())


def check_gguf(path: str | Path) -> None:
    """Raise ValueError if ``path`` is empty, not GGUF, or shorter than its tensor table says.

    Walks the header as the GGUF spec lays it out (magic, version, counts, key/value pairs, tensor infos,
    alignment padding) with the ``gguf`` package's own type sizes, without building any value.
    """
    path = Path(path)
    size = _size(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        _walk_gguf(path, _Cursor(path, data, size), size)


def _walk_gguf(path: Path, cur: "_Cursor", size: int) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

    if cur.take(4) != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (no GGUF magic at the start)")
    version = cur.u32()
    if version & 0xFFFF == 0:  # a big-endian file: rare enough not to walk
        return
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.u64(), cur.u64()
    fixed = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
             GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4,
             GGUFValueType.FLOAT32: 4, GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8,
             GGUFValueType.FLOAT64: 8}

    def skip_value(vtype: int) -> int | None:
        if vtype == GGUFValueType.STRING:
            cur.string()
            return None
        if vtype == GGUFValueType.ARRAY:
            item, count = cur.u32(), cur.u64()
            if item in fixed:
                cur.take(fixed[item] * count)
            else:
                for _ in range(count):
                    skip_value(item)
            return None
        if vtype not in fixed:
            raise ValueError(f"{path}: not a readable GGUF file (unknown value type {vtype} in its metadata)")
        raw = cur.take(fixed[vtype])
        return int.from_bytes(raw, "little") if vtype == GGUFValueType.UINT32 else None

    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = cur.string()
        value = skip_value(cur.u32())
        if key == b"general.alignment" and value:
            alignment = value
    end = 0
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.u64() for _ in range(cur.u32())]
        ggml_type, offset = cur.u32(), cur.u64()
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name.decode(errors='replace')!r} has ggml type {ggml_type}, "
                             f"which this gguf package does not know (upgrade gguf?)") from None
        n = 1
        for d in dims:
            n *= d
        end = max(end, offset + n * type_size // block)
    data_start = -(-cur.pos // alignment) * alignment
    if data_start + end > size:
        raise _truncated(path, data_start + end, size)

