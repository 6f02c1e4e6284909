"""The packed 4-bit weight layout shared by the w4a16 ops, the 4-bit checkpoint loaders and the GGUF reader
(turnout/ops/reference/w4a16.py describes it): packing, unpacking and its checks, importable from ``quant`` and
``loader`` (which call kernels only by name)."""

from __future__ import annotations

import torch

ROWS = 64  # rows of one block of the packed layout
GROUP_SIZES = (32, 64, 128, 256)


def check_layout(k: int, qweight: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
                 act_perm: torch.Tensor | None, name: str = "qweight") -> int:
    """N of a valid w4a16 weight for inputs of K columns; ValueError naming ``name`` and the shapes otherwise."""
    n = qweight.shape[0] if qweight.dim() == 2 else -1
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or n % ROWS or qweight.shape[1] * 2 != k:
        raise ValueError(f"{name}: packed 4-bit weight must be uint8 [N, K/2] with N a multiple of {ROWS} and "
                         f"K = {k}, got {str(qweight.dtype).replace('torch.', '')} {tuple(qweight.shape)}")
    if group_size not in GROUP_SIZES or k % group_size:
        raise ValueError(f"{name}: group size {group_size} must be one of {GROUP_SIZES} and divide K = {k}")
    if tuple(scale_zeros.shape) != (k // group_size, n, 2):
        raise ValueError(f"{name}: scale_zeros {tuple(scale_zeros.shape)} disagrees with the packed weight "
                         f"{tuple(qweight.shape)} and group size {group_size}: expected "
                         f"{(k // group_size, n, 2)}")
    if act_perm is not None and tuple(act_perm.shape) != (k,):
        raise ValueError(f"{name}: act_perm {tuple(act_perm.shape)} must be [{k}]")
    return n


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in 0..15 (N % 64 == 0, K even) -> qweight uint8 [N, K/2] in the layout above."""
    n, k = q.shape
    if n % ROWS or k % 2:
        raise ValueError(f"pack_int4: [N, K] with N a multiple of {ROWS} and K even, got {(n, k)}")
    b = q.to(torch.uint8).reshape(n // ROWS, 2, 32, k).permute(0, 3, 2, 1)  # [N/64, K, 32, half]
    return (b[..., 0] | (b[..., 1] << 4)).contiguous().reshape(n, k // 2)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight uint8 [N, K/2] -> q [N, K] uint8 in 0..15."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    b = qweight.reshape(n // ROWS, k, 32)
    halves = torch.stack((b & 15, b >> 4), dim=1)  # [N/64, 2, K, 32]
    return halves.permute(0, 1, 3, 2).reshape(n, k)
