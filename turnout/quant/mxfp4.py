"""MXFP4 expert weights as GPT-OSS ships them, dequantised at load.

A checkpoint of ``quant_method: "mxfp4"`` stores each quantised stack ``W`` [E, rows, cols] as two tensors
(the OCP microscaling format, blocks of 32 values along ``cols`` sharing one scale):

- ``<name>_blocks`` uint8 [E, rows, cols / 32, 16]: two FP4 (e2m1) codes per byte, the low nibble first
  (element 2j of a block in bits 0-3 of byte j, element 2j + 1 in bits 4-7);
- ``<name>_scales`` uint8 [E, rows, cols / 32]: the block's power-of-two scale in e8m0 (2 ** (s - 127)).

Value = FP4(code) * 2 ** (s - 127). ``rows`` x ``cols`` is the out x in layout (``gate_up_proj`` [E, 2I, H] with gate
and up interleaved by row, ``down_proj`` [E, H, I]); transformers' unquantised GPT-OSS layout is its transpose.
Everything else in such a checkpoint (attention, router, biases, embeddings) is stored unquantised.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

# e2m1: sign bit 3, exponent bits 2-1, mantissa bit 0 (the OCP MX spec's table)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
_PAIR = re.compile(r"^(.*)_(blocks|scales)$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                     name: str = "tensor") -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in ``dtype``. One leading index at a
    time, so a whole expert stack never exists in float32 at once. ValueError naming ``name`` on bad input."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}_blocks / {name}_scales: expected uint8 tensors, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}_blocks {tuple(blocks.shape)} and {name}_scales {tuple(scales.shape)}: expected "
                         f"blocks [..., G, {BLOCK // 2}] and scales [..., G] with the same leading dims")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * BLOCK, dtype=dtype, device=blocks.device)
    flat_b = blocks.reshape(-1, *blocks.shape[-2:]) if blocks.dim() > 2 else blocks[None]
    flat_s = scales.reshape(-1, scales.shape[-1]) if scales.dim() > 1 else scales[None]
    flat_o = out.view(-1, out.shape[-1]) if out.dim() > 1 else out[None]
    for i in range(flat_b.shape[0]):
        b = flat_b[i].long()  # [G, 16]
        vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).reshape(b.shape[0], BLOCK)  # [G, 32]
        exp = flat_s[i].to(torch.int32) - 127  # [G]
        flat_o[i].copy_(torch.ldexp(vals, exp[:, None].float()).reshape(-1))
    return out


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each ``<name>_blocks`` / ``<name>_scales`` pair replaced by ``<name>``
    dequantised and transposed to [E, cols, rows] (transformers' unquantised GPT-OSS layout, which the
    experts' loaders take). The two halves of a pair may come in any order; one without the other is a
    ValueError naming it."""
    pending: dict[tuple[str, str], torch.Tensor] = {}
    for name, tensor in weights:
        m = _PAIR.match(name)
        if m is None:
            yield name, tensor
            continue
        base, kind = m.groups()
        other = pending.pop((base, "scales" if kind == "blocks" else "blocks"), None)
        if other is None:
            pending[(base, kind)] = tensor
            continue
        blocks, scales = (tensor, other) if kind == "blocks" else (other, tensor)
        w = dequantize_mxfp4(blocks, scales, dtype, base)  # [E, rows, cols]
        if w.dim() != 3:
            raise ValueError(f"{base}_blocks {tuple(blocks.shape)}: expected a stack of experts [E, rows, G, 16]")
        yield base, w.transpose(1, 2)
    if pending:
        (base, kind), t = next(iter(pending.items()))
        missing = "scales" if kind == "blocks" else "blocks"
        raise ValueError(f"checkpoint tensor {base}_{kind!s} {tuple(t.shape)} has no {base}_{missing}: an MXFP4 "
                         "weight needs both")
