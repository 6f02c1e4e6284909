"""w4a16_linear on the CPU, reading the packed 4-bit blocks (layout: turnout/ops/reference/w4a16.py).

* bfloat16 inputs: torch's own int4 kernel (``_weight_int4pack_mm_for_cpu``), whose layout the op's is. It is
  vectorised for bfloat16 only (float32 and float16 inputs take its scalar loop: 100x slower, measured on this
  box), and it returns bfloat16, so it serves exactly the bfloat16 case.
* float32 / float16: dequantise a slab of 64-row blocks at a time into float32 and multiply it, so the float
  copy of a slab stays in cache and the whole float weight never exists. The value is the reference's (the same
  float32 dequantisation), only the summation order differs.
"""

from __future__ import annotations

import torch

from turnout.ops.w4_layout import ROWS, check_layout

_SLAB_BYTES = 8 << 20  # float32 bytes of one dequantised slab: few torch calls a projection (each costs ~10 us)
_INT4_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)


def _unpack(raw: torch.Tensor) -> torch.Tensor:
    """[nb, K, 32] packed bytes -> [nb, K, 64] uint8 values (column j: row 64 b + j), four bytes at a time as
    int32 (torch's uint8 shifts are not vectorised)."""
    out = torch.empty(*raw.shape[:-1], ROWS, dtype=torch.uint8)
    words, o = raw.view(torch.int32), out.view(torch.int32)
    torch.bitwise_and(words, 0x0F0F0F0F, out=o[..., :8])
    torch.bitwise_and(words >> 4, 0x0F0F0F0F, out=o[..., 8:])
    return out


def _slab_product(x: torch.Tensor, qweight: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
                  y: torch.Tensor) -> None:
    m, k = x.shape
    n = qweight.shape[0]
    blocks, groups = n // ROWS, k // group_size
    per = max(1, _SLAB_BYTES // (k * ROWS * 4))
    packed = qweight.view(blocks, k, 32)
    sz = scale_zeros.float().view(groups, blocks, ROWS, 2)
    scale = sz[..., 0].transpose(0, 1).contiguous().unsqueeze(2)  # [nb, G, 1, 64]
    zero = (sz[..., 1] - 8.0 * sz[..., 0]).transpose(0, 1).contiguous().unsqueeze(2)  # q s + (z - 8 s)
    xb = x.unsqueeze(0)
    for b0 in range(0, blocks, per):
        b1 = min(blocks, b0 + per)
        w = _unpack(packed[b0:b1]).float().view(b1 - b0, groups, group_size, ROWS)
        w = torch.addcmul(zero[b0:b1], w, scale[b0:b1])
        part = torch.bmm(xb.expand(b1 - b0, m, k), w.view(b1 - b0, k, ROWS))  # [nb, M, 64]
        y[:, b0 * ROWS:b1 * ROWS].view(m, b1 - b0, ROWS).copy_(part.transpose(0, 1))


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
                 act_perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See turnout/ops/reference/w4a16.py."""
    if x.dim() != 2:
        raise ValueError(f"w4a16_linear takes x [M, K], got {tuple(x.shape)}")
    n = check_layout(x.shape[1], qweight, scale_zeros, group_size, act_perm)
    if act_perm is not None:
        x = x.index_select(1, act_perm)
    if x.dtype == torch.bfloat16 and _INT4_MM is not None and x.shape[0] and x.shape[1]:
        y = _INT4_MM(x.contiguous(), qweight, group_size, scale_zeros.to(torch.bfloat16).contiguous())
        return y if bias is None else y + bias.to(y.dtype)
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    if x.shape[0] and n:
        _slab_product(x.float().contiguous(), qweight, scale_zeros, group_size, y)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
