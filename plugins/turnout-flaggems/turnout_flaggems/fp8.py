"""fp8 activation quantisation and the fp8 GEMMs through FlagGems, in turnout's contracts
(turnout/ops/reference/fp8.py). Shapes FlagGems does not serve go to ``fallback``, with the reason logged once."""

from __future__ import annotations

import torch

from turnout_flaggems.library import decline

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
# turnout's smallest dynamic scale is 1 / (448 * 512); FlagGems floors max |x| at eps before dividing by 448
EPS = 1.0 / 512.0


def quantize_fp8(x, group_size=0, input_scale=None, *, gems, fallback):
    """Dynamic per token (a group as wide as the row) or per 128 group: ``per_token_group_quant_fp8``, whose
    scale max(max |x|, eps) / 448 is turnout's max(max |x| / 448, 1 / (448 * 512)). A static scale, or a
    row that is not whole groups, goes to ``fallback``."""
    if input_scale is not None:
        decline("quantize_fp8", "a static input scale (FlagGems quantises dynamically)")
        return fallback(x, group_size, input_scale)
    width = x.shape[-1] if group_size == 0 else group_size
    if x.dim() != 2 or group_size not in (0, BLOCK) or x.shape[-1] % width:
        decline("quantize_fp8", f"rows of {x.shape[-1]} in groups of {group_size} (FlagGems needs whole groups)")
        return fallback(x, group_size, input_scale)
    return gems.per_token_group_quant_fp8(x.contiguous(), width, eps=EPS, dtype=FP8)


def scaled_mm(xq, x_scale, weight, weight_scale, bias=None, out_dtype=torch.bfloat16, *, gems, fallback):
    """Row-wise scaled: ``cutlass_scaled_mm(c, a, b, a_scale, b_scale, bias)`` with b = weight^T (the column-
    major operand it asks for is turnout's [N, K] weight transposed, no copy) and the output allocated here.
    It asks for 16-element aligned rows of b and c."""
    m, k = xq.shape
    n = weight.shape[0]
    if weight.stride(1) != 1 or weight.stride(0) % 16 or n % 16 or xq.stride(1) != 1:
        decline("scaled_mm", f"N = {n}, K = {k} (FlagGems' scaled_mm needs 16-aligned rows)")
        return fallback(xq, x_scale, weight, weight_scale, bias, out_dtype)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    gems.cutlass_scaled_mm(out, xq, weight.t(), x_scale.float().contiguous(), weight_scale.float().contiguous(),
                           None if bias is None else bias.to(out_dtype).contiguous())
    return out


def block_scaled_mm(xq, x_scale, weight, weight_scale, bias=None, out_dtype=torch.bfloat16, *, gems):
    """``w8a8_block_fp8_matmul(A, B, As, Bs, [128, 128], output_dtype)``: As must be per 128 group, so per-token
    scales [M, 1] are repeated over the groups (the same value). With a bias the product is taken in float32
    and the bias added there, as the reference does, then rounded once."""
    m, k = xq.shape
    groups = -(-k // BLOCK)
    x_scale = x_scale.float()
    if x_scale.shape[1] != groups:
        x_scale = x_scale.expand(m, groups)
    y = gems.w8a8_block_fp8_matmul(xq.contiguous(), weight, x_scale.contiguous(), weight_scale.float(),
                                   [BLOCK, BLOCK], output_dtype=out_dtype if bias is None else torch.float32)
    return y if bias is None else (y + bias.float()).to(out_dtype)
