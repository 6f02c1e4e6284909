"""4-bit weights with float activations (w4a16): the layout every implementation and every checkpoint format
shares, and its reference.

One layout, chosen because the CPU's own int4 kernel (``torch.ops.aten._weight_int4pack_mm_for_cpu``) reads it
as it is, and because it streams well on a GPU (each 64-row block is one contiguous run of bytes):

* ``qweight`` uint8 ``[N, K/2]`` holds the 4-bit values ``q[n, k]`` in 0..15 of an ``[N, K]`` weight, rows
  in blocks of 64 (N % 64 == 0): viewed as ``[N/64, K, 32]``, byte ``[b, k, j]`` is
  ``q[64 b + j, k] | q[64 b + 32 + j, k] << 4`` (torch's ``_convert_weight_to_int4pack_for_cpu``);
* ``scale_zeros`` ``[K/G, N, 2]`` (a float dtype), for group size G in 32, 64, 128, 256: the weight's value is
  ``(q[n, k] - 8) * scale_zeros[k // G, n, 0] + scale_zeros[k // G, n, 1]``. A symmetric format has zero 0;
  a format with integer zero points z stores ``(8 - z) * scale``; GGUF's Q4_1 ``q d + m`` stores ``m + 8 d``;
* ``act_perm`` ``[K]`` int64 or None: activation order (GPTQ ``desc_act``). The loader sorts K by group
  (``g_idx``) so that each group is contiguous; stored column j multiplies input column ``act_perm[j]``.

The reference dequantises in float32 and multiplies in float32, the exact value of the dequantised model.
"""

from __future__ import annotations

import torch

from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase
from turnout.ops.w4_layout import GROUP_SIZES, ROWS, check_layout, pack_int4, unpack_int4

__all__ = ["GROUP_SIZES", "ROWS", "check_layout", "dequantize_w4", "pack_int4", "random_w4", "unpack_int4",
           "w4a16_linear"]


def dequantize_w4(qweight: torch.Tensor, scale_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 weight [N, K] (stored column order) of a packed 4-bit weight."""
    q = unpack_int4(qweight).float()
    n, k = q.shape
    sz = scale_zeros.float().permute(1, 0, 2)  # [N, G, 2]
    w = (q.view(n, k // group_size, group_size) - 8.0) * sz[..., :1] + sz[..., 1:]
    return w.view(n, k)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
                 act_perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float) times a packed 4-bit weight (layout above) -> [M, N] in x's dtype:
    ``x[:, act_perm] W^T (+ bias)``, dequantised and accumulated in float32."""
    if x.dim() != 2:
        raise ValueError(f"w4a16_linear takes x [M, K], got {tuple(x.shape)}")
    check_layout(x.shape[1], qweight, scale_zeros, group_size, act_perm)
    xf = x.float() if act_perm is None else x.float().index_select(1, act_perm)
    y = xf @ dequantize_w4(qweight, scale_zeros, group_size).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---- declarations and sample inputs -----------------------------------------------------------------

def random_w4(n: int, k: int, group_size: int, dtype, device, gen, zeros: bool = True):
    """A random packed weight (qweight, scale_zeros) whose values are about N(0, 1/K)."""
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand((k // group_size, n, 1), generator=gen) * (0.5 * k ** -0.5) + 0.05 * k ** -0.5
    zero = (torch.randn((k // group_size, n, 1), generator=gen) * scale) if zeros else torch.zeros_like(scale)
    return pack_int4(q).to(device), torch.cat((scale, zero), dim=2).to(device=device, dtype=dtype)


# (M, N, K, group, zero points, act order, bias): one row (decode), a few, many (prefill); SmolLM2's k/v shape.
_SHAPES = [(1, 64, 128, 32, True, False, False), (1, 128, 64, 64, True, False, True), (1, 192, 576, 32, True, False, True),
           (1, 128, 256, 128, False, True, False), (3, 128, 256, 64, True, True, True),
           (16, 64, 384, 128, False, False, False), (37, 192, 256, 32, True, False, True),
           (70, 128, 512, 256, True, True, False)]


def _samples(device, dtype, gen):
    for m, n, k, g, zeros, perm, bias in _SHAPES:
        qw, sz = random_w4(n, k, g, dtype, device, gen, zeros)
        p = torch.randperm(k, generator=gen).to(device) if perm else None
        b = randn((n,), dtype, device, gen) if bias else None
        yield SampleCase(f"M{m}N{n}K{k}_g{g}{'_zp' if zeros else '_sym'}{'_perm' if perm else ''}"
                         f"{'_bias' if bias else ''}", (randn((m, k), dtype, device, gen), qw, sz, g, p, b))


W4A16_LINEAR = OpSpec(
    "w4a16_linear", w4a16_linear, _samples,
    tolerance={"float32": (2e-5, 2e-5), "float16": (3e-3, 3e-3), "bfloat16": (3e-2, 3e-2)},
    doc="x[:, perm] W^T (+ b) with W packed 4-bit (blocks of 64 rows, group scales and zeros), x float")
