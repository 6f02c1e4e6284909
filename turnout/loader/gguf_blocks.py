"""GGUF's 4-bit blocks kept 4-bit: Q4_0 and Q4_1 decoder projections read into the w4a16 layout
(turnout/ops/reference/w4a16.py) instead of being inflated to float32 (``--quantization gguf``, vLLM's spelling).

A Q4_0 block is 32 weights in 18 bytes: a float16 scale d, then 16 bytes whose low nibbles are weights 0..15 and
high nibbles weights 16..31; the value is (q - 8) d. Q4_1 (20 bytes) adds a float16 minimum m after d: q d + m,
which the layout holds as scale d and zero m + 8 d. Groups are the blocks (32 weights of a row).

Only a file whose every decoder projection is Q4_0 or Q4_1 (with rows in whole 64-row blocks) can keep its
blocks; the embedding, the LM head and norms load as before. Any other file is refused naming its first other
tensor, so the option never half applies.
"""

from __future__ import annotations

import re

import numpy as np
import torch

Q4_TYPES = {2: "Q4_0", 3: "Q4_1"}  # GGMLQuantizationType values
_BYTES = {2: 18, 3: 20}
GROUP = 32
DECODER_LINEARS = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")


def q4_blocks(data: np.ndarray, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw Q4_0 / Q4_1 rows (uint8 [rows, row bytes]) -> (q uint8 [rows, K], scale_zeros float32 [rows, K/32, 2])
    with value (q - 8) scale + zero."""
    size = _BYTES[ggml_type]
    raw = torch.from_numpy(np.array(data, dtype=np.uint8)).view(data.shape[0], -1, size)  # a copy: the map is read-only
    rows, blocks = raw.shape[:2]
    d = raw[..., 0:2].contiguous().view(torch.float16).float()
    qs = raw[..., size - 16:]
    q = torch.cat((qs & 15, qs >> 4), dim=2).reshape(rows, blocks * GROUP)
    if ggml_type == 3:
        zero = raw[..., 2:4].contiguous().view(torch.float16).float() + 8.0 * d
    else:
        zero = torch.zeros_like(d)
    return q, torch.cat((d, zero), dim=2)


def check_keepable(reader) -> None:
    """ValueError naming the first decoder projection that cannot keep 4-bit blocks (``quantization='gguf'``)."""
    found = False
    for t in reader.tensors:
        if not DECODER_LINEARS.match(t.name):
            continue
        found = True
        kind = int(t.tensor_type)
        if kind not in Q4_TYPES:
            raise ValueError(f"quantization: 'gguf' keeps Q4_0 / Q4_1 blocks, and tensor {t.name} is "
                             f"{t.tensor_type.name}; load this file without it (dequantised to float)")
        if int(t.data.shape[0]) % 64:
            raise ValueError(f"quantization: 'gguf' needs projections of whole 64-row blocks, and tensor {t.name} "
                             f"has {int(t.data.shape[0])} rows")
    if not found:
        raise ValueError("quantization: 'gguf' found no decoder projections in this file")


def w4_method(reader):
    """The linear layers' method for a file whose projections keep their blocks (``check_keepable`` first)."""
    from turnout.quant.w4 import W4LinearMethod
    from turnout.quant.w4_config import W4Config

    check_keepable(reader)
    kinds = sorted({Q4_TYPES[int(t.tensor_type)] for t in reader.tensors if DECODER_LINEARS.match(t.name)})
    return W4LinearMethod(W4Config("gguf", GROUP, False, False, 0, f"GGUF {'/'.join(kinds)} blocks kept"))
