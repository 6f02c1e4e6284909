"""The 4-bit checkpoint tensors of each format (turnout/quant/w4_config.py) -> logical tensors in one orientation:
q uint8 [N, K] (the unsigned 4-bit value, 0..15, of output row n and input column k), scales [N, G] and integer
zero points z' uint8 [N, G] on the same unsigned scale (value = (q - z') s; symmetric formats: z' = 8), before
any tensor-parallel slicing. Each unpacker checks its tensor against the shape the layer expects and names the
tensor when it disagrees (a checkpoint whose packed tensor and scales do not describe the same weight)."""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
_AWQ_INVERSE = [AWQ_ORDER.index(c) for c in range(8)]


def nibbles(t: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i (bits 4i..4i+3) of each word, in order."""
    if t.dtype != torch.int32:
        raise ValueError(f"expected int32 packed words, got {str(t.dtype).replace('torch.', '')}")
    return ((t.unsqueeze(-1) >> _SHIFTS.to(t.device)) & 15).to(torch.uint8)


def _want(what: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what} {tuple(t.shape)} disagrees with the layer's weight: expected {tuple(shape)}")


def unpack_q(fmt: str, t: torch.Tensor, n: int, k: int, name: str) -> torch.Tensor:
    """The packed weight tensor ``name`` -> q uint8 [n, k]."""
    if fmt == "gguf":  # the GGUF reader's blocks, already unpacked (turnout/loader/gguf_blocks.py)
        _want(name, t, (n, k))
        return t
    if fmt == "awq":  # [K, N/8], along N in AWQ's order
        _want(name, t, (k, n // 8))
        return nibbles(t)[..., _AWQ_INVERSE].reshape(k, n).T.contiguous()
    if fmt == "gptq":  # [K/8, N], along K
        _want(name, t, (k // 8, n))
        return nibbles(t.T.contiguous()).reshape(n, k)
    _want(name, t, (n, k // 8))  # compressed-tensors [N, K/8], along K
    return nibbles(t).reshape(n, k)


def unpack_scales(fmt: str, t: torch.Tensor, n: int, groups: int, name: str) -> torch.Tensor:
    """The scales tensor -> [n, groups] (float32)."""
    if fmt == "ct":
        _want(name, t, (n, groups))
        return t.float()
    _want(name, t, (groups, n))
    return t.float().T


def unpack_zeros(fmt: str, t: torch.Tensor, n: int, groups: int, offset: int, name: str) -> torch.Tensor:
    """The packed zero points -> z' uint8 [n, groups] (value = (q - z') s)."""
    if fmt == "ct":  # [ceil(N/8), G], along N, stored as zp + 8: exactly z' on the unsigned scale
        _want(name, t, ((n + 7) // 8, groups))
        return nibbles(t.T.contiguous()).reshape(groups, -1)[:, :n].T.contiguous()
    _want(name, t, (groups, n // 8))
    z = nibbles(t)
    if fmt == "awq":
        z = z[..., _AWQ_INVERSE]
    return (z.reshape(groups, n).T + offset).contiguous()


def act_order(g_idx: torch.Tensor, group_size: int, name: str) -> torch.Tensor | None:
    """The column order that makes each group contiguous (stable sort by group), or None when ``g_idx`` is the
    plain k // group_size. ValueError naming ``name`` when a group does not hold exactly group_size columns."""
    g = g_idx.to(torch.int64).reshape(-1)
    k = g.numel()
    if torch.equal(g, torch.arange(k, device=g.device) // group_size):
        return None
    counts = torch.bincount(g, minlength=k // group_size)
    if g.min() < 0 or counts.numel() != k // group_size or (counts != group_size).any():
        raise ValueError(f"{name}: every group must hold exactly {group_size} input columns")
    return torch.argsort(g, stable=True)
