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


def check_experts(hidden_size: int, w13_qweight: torch.Tensor, w13_scale_zeros: torch.Tensor,
                  w2_qweight: torch.Tensor, w2_scale_zeros: torch.Tensor, group_size: int,
                  w13_perm: torch.Tensor | None = None, w2_perm: torch.Tensor | None = None) -> tuple[int, int]:
    """(E, I) of valid 4-bit expert stacks (moe_experts_w4a16) for hidden rows of ``hidden_size``: each expert's
    gate/up [2I, H] and down [H, I] a w4a16 weight, gate and up each whole 64-row blocks. ValueError naming the
    tensor otherwise."""
    if w13_qweight.dim() != 3 or w2_qweight.dim() != 3 or w13_scale_zeros.dim() != 4 or w2_scale_zeros.dim() != 4:
        raise ValueError(f"moe_experts_w4a16: expert stacks must be w13_qweight [E, 2I, H/2], w13_scale_zeros "
                         f"[E, H/G, 2I, 2], w2_qweight [E, H, I/2], w2_scale_zeros [E, I/G, H, 2], got "
                         f"{tuple(w13_qweight.shape)}, {tuple(w13_scale_zeros.shape)}, {tuple(w2_qweight.shape)}, "
                         f"{tuple(w2_scale_zeros.shape)}")
    e, two_i = w13_qweight.shape[:2]
    inter = two_i // 2
    if inter % ROWS or two_i != 2 * inter:
        raise ValueError(f"w13_qweight: the gate and the up of an expert must each be whole blocks of {ROWS} rows, "
                         f"got 2I = {two_i}")
    for name, t in (("w13_scale_zeros", w13_scale_zeros), ("w2_qweight", w2_qweight),
                    ("w2_scale_zeros", w2_scale_zeros)):
        if t.shape[0] != e:
            raise ValueError(f"{name}: {t.shape[0]} experts, w13_qweight has {e}")
    for name, p, k in (("w13_perm", w13_perm, hidden_size), ("w2_perm", w2_perm, inter)):
        if p is not None and tuple(p.shape) != (e, k):
            raise ValueError(f"{name} {tuple(p.shape)} must be [{e}, {k}]")
    check_layout(hidden_size, w13_qweight[0], w13_scale_zeros[0], group_size,
                 None if w13_perm is None else w13_perm[0], "w13_qweight")
    n2 = check_layout(inter, w2_qweight[0], w2_scale_zeros[0], group_size,
                      None if w2_perm is None else w2_perm[0], "w2_qweight")
    if n2 != hidden_size:
        raise ValueError(f"w2_qweight: {n2} output rows, hidden size {hidden_size}")
    return e, inter
