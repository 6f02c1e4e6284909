"""FP8 (e4m3fn) linear algebra: activation quantisation and the scaled matrix products.

The layouts, shared by every implementation and by turnout/quant:

* an fp8 weight is ``weight [N, K]`` (torch.float8_e4m3fn) with float32 scales, either one per output row,
  ``[N, 1]`` (per-channel; a per-tensor checkpoint scale is broadcast to the rows of its tensor), or one per
  128 x 128 block, ``[ceil(N/128), ceil(K/128)]`` (DeepSeek-V3, the Qwen3 FP8 releases: ``weight_scale_inv``);
  its value is ``weight.float() * scale`` (of its row, or of its block);
* a quantised activation is ``xq [M, K]`` fp8 with float32 scales ``[M, 1]`` (per token, or a static
  per-tensor scale broadcast) or ``[M, ceil(K/128)]`` (per token and 128-wide group of K, the block
  models' activations).

Four ops, so that each implementation serves the whole of its op (the dispatch layer then says which one
runs each layout): ``quantize_fp8``; ``scaled_mm`` (per-row weight scales, per-token activation scales: the
layout of ``torch._scaled_mm``'s row-wise scaling); ``block_scaled_mm`` (block weight scales); and
``fp8_linear``, the weight-only product with an unquantised x (checkpoints without activation quantisation,
and batch-1 decode, where a kernel streaming the fp8 weight is the whole cost). The references dequantise
and multiply in float32: this is the exact meaning, and the fallback where no fp8 matrix units exist.
"""

from __future__ import annotations

import torch

from turnout.ops.reference._util import compare_tensors, randn
from turnout.ops.spec import OpSpec, SampleCase

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128  # the block / group size of the block layouts
# The smallest scale a dynamic quantisation uses (an all-zero row must not divide by zero).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _expand_cols(scale: torch.Tensor, k: int) -> torch.Tensor:
    """[R, G] group scales -> [R, K] (group g covers columns [128 g, 128 (g + 1))); G == 1: one per row."""
    if scale.shape[1] == 1:
        return scale.expand(scale.shape[0], k)
    return scale.repeat_interleave(BLOCK, dim=1)[:, :k]


def weight_layout(weight: torch.Tensor, weight_scale: torch.Tensor) -> str:
    """"row" ([N, 1]) or "block" ([ceil(N/128), ceil(K/128)]); ValueError naming the shapes otherwise."""
    n, k = weight.shape
    if weight_scale.dim() == 2 and tuple(weight_scale.shape) == (n, 1):
        return "row"
    if weight_scale.dim() == 2 and tuple(weight_scale.shape) == (_cdiv(n, BLOCK), _cdiv(k, BLOCK)):
        return "block"
    raise ValueError(f"weight_scale {tuple(weight_scale.shape)} fits neither per-row [{n}, 1] nor 128x128 blocks "
                     f"[{_cdiv(n, BLOCK)}, {_cdiv(k, BLOCK)}] of weight {tuple(weight.shape)}")


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The float32 value [N, K] of an fp8 weight in either layout."""
    n, k = weight.shape
    s = weight_scale.float()
    if weight_layout(weight, weight_scale) == "block":
        s = _expand_cols(s, k).repeat_interleave(BLOCK, dim=0)[:n]
    return weight.float() * s


def dequantize_act(xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """The float32 value [M, K] of a quantised activation ([M, 1] or [M, ceil(K/128)] scales)."""
    m, k = xq.shape
    if x_scale.dim() != 2 or x_scale.shape[0] != m or x_scale.shape[1] not in (1, _cdiv(k, BLOCK)):
        raise ValueError(f"x_scale {tuple(x_scale.shape)} must be [{m}, 1] or [{m}, {_cdiv(k, BLOCK)}]")
    return xq.float() * _expand_cols(x_scale.float(), k)


def quantize_fp8(x: torch.Tensor, group_size: int = 0, input_scale: torch.Tensor | None = None):
    """x [M, K] (any float dtype) -> (xq [M, K] fp8 e4m3fn, scale [M, G] float32), x ~ xq * scale.

    ``input_scale`` (a one-element tensor): a static per-tensor scale (checkpoints with ``input_scale``),
    G = 1. Else dynamic: ``group_size`` 0 is one scale per row (per token), 128 one per row and 128-wide
    group of K (G = ceil(K/128)); each scale is the group's max |x| / 448 (at least ``MIN_SCALE``). Values
    are divided by their scale in float32, clamped to +-448 and rounded to nearest."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8 takes x [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    xf = x.float()
    if input_scale is not None:
        if input_scale.numel() != 1:
            raise ValueError(f"quantize_fp8: input_scale must have one element, got {tuple(input_scale.shape)}")
        scale = input_scale.float().reshape(1, 1).expand(m, 1).contiguous()
    elif group_size == 0:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    elif group_size == BLOCK:
        g = _cdiv(k, BLOCK)
        padded = torch.nn.functional.pad(xf.abs(), (0, g * BLOCK - k))
        scale = (padded.view(m, g, BLOCK).amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)
    else:
        raise ValueError(f"quantize_fp8: group_size must be 0 (per token) or {BLOCK}, got {group_size}")
    q = (xf / _expand_cols(scale, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def _bias_out(y: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Row-wise scaled fp8 GEMM: xq [M, K] fp8 with x_scale [M, 1], weight [N, K] fp8 with weight_scale [N, 1],
    bias [N] or None -> [M, N] in ``out_dtype``: (xq * x_scale) (weight * weight_scale)^T (+ bias)."""
    if x_scale.shape != (xq.shape[0], 1) or weight_layout(weight, weight_scale) != "row":
        raise ValueError(f"scaled_mm takes per-row scales: x_scale [M, 1] and weight_scale [N, 1], got "
                         f"{tuple(x_scale.shape)} and {tuple(weight_scale.shape)}")
    return _bias_out(dequantize_act(xq, x_scale) @ dequantize_weight(weight, weight_scale).T, bias, out_dtype)


def block_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block-scaled fp8 GEMM: weight_scale [ceil(N/128), ceil(K/128)], x_scale [M, ceil(K/128)] (per 128
    group) or [M, 1]; otherwise as ``scaled_mm``."""
    if weight_layout(weight, weight_scale) != "block":
        raise ValueError(f"block_scaled_mm takes 128x128 block weight scales, got {tuple(weight_scale.shape)}")
    return _bias_out(dequantize_act(xq, x_scale) @ dequantize_weight(weight, weight_scale).T, bias, out_dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only fp8: x [M, K] unquantised, weight [N, K] fp8 in either layout -> [M, N] in x's dtype,
    x (weight * scale)^T (+ bias), accumulated in float32."""
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_linear takes x [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}")
    return _bias_out(x.float() @ dequantize_weight(weight, weight_scale).T, bias, x.dtype)


# ---- declarations and sample inputs -----------------------------------------------------------------

def quantize_weight(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (fp8 weight, scales) in ``layout`` ("row" or "block"): max |w| / 448 per row
    or per 128 x 128 block. Used by the sample inputs, online quantisation and fp8 dummy weights."""
    n, k = w.shape
    wf = w.float()
    if layout == "row":
        scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        full = scale
    elif layout == "block":
        nb, kb = _cdiv(n, BLOCK), _cdiv(k, BLOCK)
        padded = torch.nn.functional.pad(wf.abs(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
        scale = (padded.view(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
        full = _expand_cols(scale, k).repeat_interleave(BLOCK, dim=0)[:n]
    else:
        raise ValueError(f"weight layout must be 'row' or 'block', got {layout!r}")
    return (wf / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


# (M, N, K, bias): one row (decode), a few rows, more than the small-M limit; N and K off the tile multiples.
_SHAPES = [(1, 64, 256, False), (1, 130, 300, True), (3, 256, 384, False), (16, 200, 128, True),
           (37, 96, 200, False)]


def _weight(n, k, layout, device, gen):
    w, s = quantize_weight(randn((n, k), torch.float32, "cpu", gen, k ** -0.5), layout)
    return w.to(device), s.to(device)


def _bias(n, on, dtype, device, gen):
    return randn((n,), dtype, device, gen) if on else None


def _quant_samples(device, dtype, gen):
    for m, k, group, static in [(1, 256, 0, False), (5, 300, 128, False), (16, 128, 0, True), (33, 520, 128, False),
                                (4, 64, 0, False)]:
        x = randn((m, k), dtype, device, gen, 3.0)
        if m == 4:
            x[1] = 0  # an all-zero row takes the minimum scale
        scale = torch.tensor([0.02], device=device) if static else None
        yield SampleCase(f"M{m}K{k}_{'static' if static else f'g{group}'}", (x, group, scale))


def _mm_samples(layout, groups):
    def samples(device, dtype, gen):
        for i, (m, n, k, bias) in enumerate(_SHAPES):
            group = groups[i % len(groups)]
            xq, xs = quantize_fp8(randn((m, k), torch.float32, "cpu", gen, 2.0), group)
            w, s = _weight(n, k, layout, device, gen)
            yield SampleCase(f"M{m}N{n}K{k}_g{group}{'_bias' if bias else ''}",
                             (xq.to(device), xs.to(device), w, s, _bias(n, bias, dtype, device, gen), dtype))
    return samples


def _linear_samples(device, dtype, gen):
    for i, (m, n, k, bias) in enumerate(_SHAPES):
        layout = ("row", "block")[i % 2]
        w, s = _weight(n, k, layout, device, gen)
        yield SampleCase(f"M{m}N{n}K{k}_{layout}{'_bias' if bias else ''}",
                         (randn((m, k), dtype, device, gen), w, s, _bias(n, bias, dtype, device, gen)))


def compare_quantized(ref: list, got: list, case) -> tuple[bool, float, str]:
    """quantize_fp8: the scales equal (float32 rounding), the dequantised values within one fp8 step (a
    division that rounds the other way at a tie moves one element by a step, never more)."""
    (rq, rs), (gq, gs) = ref, got
    if rq.shape != gq.shape or rs.shape != gs.shape or gq.dtype != FP8:
        return False, float("inf"), f"got {gq.dtype} {tuple(gq.shape)} / {tuple(gs.shape)}, expected fp8 " \
                                    f"{tuple(rq.shape)} / {tuple(rs.shape)}"
    rs, gs = rs.cpu().float(), gs.cpu().float()
    s_err = ((rs - gs).abs() / rs.abs()).max().item()
    if s_err > 1e-6:
        return False, s_err, f"scales differ by {s_err:.3g} (relative)"
    k = rq.shape[1]
    r, g = dequantize_act(rq.cpu(), rs), dequantize_act(gq.cpu(), rs)
    err = (r - g).abs()
    bound = 0.126 * r.abs() + _expand_cols(rs, k) * 2.0 ** -9  # one e4m3 step (3 mantissa bits; subnormals)
    worst = err.max().item() if err.numel() else 0.0
    if (err > bound).any():
        return False, worst, f"dequantised values off by more than one fp8 step (max error {worst:.3g})"
    return True, worst, ""


_MM_TOL = {"float32": (2e-4, 2e-4), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}
# fp8 x fp8 products on sm90 matrix units are exact, but the sum within one instruction sequence keeps about
# 14 bits (DeepSeek-V3 report, section 3.3.2; Triton's sm90 default for fp8 dots): the Triton GEMM adds each
# 128-wide K tile into a float32 accumulator (the usual promotion interval), so its error is about
# 2^-13 * sum_k |x_k w_k| (measured on the H200: 0.0020 at M37N96K200, where that estimate is 0.0018). The
# bound allows 4x that on top of the output dtype's tolerance; a wrong scale or group is off by ~sum / sqrt(K).
_FP8_ACC = 2.0 ** -11


def compare_fp8_mm(ref: list, got: list, case) -> tuple[bool, float, str]:
    """scaled_mm / block_scaled_mm: |got - ref| <= atol + rtol |ref| + 2^-11 sum_k |x_k w_k| (see _FP8_ACC)."""
    xq, x_scale, weight, weight_scale, _, out_dtype = case.args
    atol, rtol = _MM_TOL[str(out_dtype).removeprefix("torch.")]
    if len(ref) != 1 or len(got) != 1 or got[0].shape != ref[0].shape:
        return compare_tensors(ref, got, atol, rtol)
    mags = dequantize_act(xq, x_scale).abs() @ dequantize_weight(weight, weight_scale).abs().T
    r, g = ref[0].cpu().float(), got[0].cpu().float()
    err = (r - g).abs()
    worst = err.max().item() if err.numel() else 0.0
    if torch.isnan(g).any() or (err > atol + rtol * r.abs() + _FP8_ACC * mags.cpu()).any():
        return False, worst, f"output 0: max error {worst:.3g} beyond atol={atol} rtol={rtol} + 2^-11 sum|x w|"
    return True, worst, ""


QUANTIZE_FP8 = OpSpec("quantize_fp8", quantize_fp8, _quant_samples, compare=compare_quantized,
                      doc="x [M, K] -> (fp8 x, float32 scales [M, 1] per token / static, or [M, ceil(K/128)])")
SCALED_MM = OpSpec("scaled_mm", scaled_mm, _mm_samples("row", (0,)), tolerance=_MM_TOL, compare=compare_fp8_mm,
                   doc="fp8 x fp8 GEMM with per-token and per-channel scales -> out_dtype")
BLOCK_SCALED_MM = OpSpec("block_scaled_mm", block_scaled_mm, _mm_samples("block", (128, 0)), tolerance=_MM_TOL,
                         compare=compare_fp8_mm,
                         doc="fp8 x fp8 GEMM with 128x128 block weight scales, per-token or per-128-group x scales")
FP8_LINEAR = OpSpec("fp8_linear", fp8_linear, _linear_samples, tolerance=_MM_TOL,
                    doc="x W^T (+ b) with an fp8 weight (per-row or 128x128 block scales), x unquantised")
