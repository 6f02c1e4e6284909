"""Gated activations over a packed gate/up projection: x [T, 2I] holds this rank's gate then its up (the layout
``MergedColumnParallelLinear`` packs), the result is [T, I]."""

import torch
import torch.nn.functional as F

from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] (gate then up) -> [T, I] = silu(gate) * up."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] (gate then up) -> [T, I] = gelu(gate, tanh approximation) * up: GeGLU as Gemma computes it
    (HF's ``gelu_pytorch_tanh``), the activation rounded to x's dtype before the product."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """x: [T, 2*I] (gate then up) -> [T, I], GPT-OSS's gated unit: gate clamped above at ``limit``, up clamped
    to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate). Each step in x's dtype, as HF does it."""
    d = x.shape[-1] // 2
    gate = x[..., :d].clamp(max=limit)
    up = x[..., d:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


_SHAPES = [(1, 64), (6, 96), (31, 256), (3, 1000)]


def _samples(device, dtype, gen):
    for t, i in _SHAPES:
        yield SampleCase(f"T{t}xI{i}", (randn((t, 2 * i), dtype, device, gen, 2.0),))


def _clamped_samples(device, dtype, gen):
    # scale 6 puts a good share of the gates and ups past the limit of 7 on either side
    for t, i in _SHAPES:
        yield SampleCase(f"T{t}xI{i}", (randn((t, 2 * i), dtype, device, gen, 6.0), 1.702, 7.0))


_TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}

SILU_AND_MUL = OpSpec("silu_and_mul", silu_and_mul, _samples, tolerance=_TOL,
                      doc="SwiGLU activation: silu(x[:, :I]) * x[:, I:]")
GELU_TANH_AND_MUL = OpSpec("gelu_tanh_and_mul", gelu_tanh_and_mul, _samples, tolerance=_TOL,
                           doc="GeGLU activation (Gemma): gelu_tanh(x[:, :I]) * x[:, I:]")
# bf16: the reference rounds after each of its five steps, the kernel once; (up + 1) near |up| = 7 spans 2 bf16 ulps
CLAMPED_SWIGLU = OpSpec("clamped_swiglu", clamped_swiglu, _clamped_samples,
                        tolerance={"float32": (1e-5, 1e-5), "float16": (4e-3, 4e-3), "bfloat16": (6e-2, 3e-2)},
                        doc="GPT-OSS's clamped SwiGLU: (clamp(up, -l, l) + 1) * g * sigmoid(alpha g), g = min(gate, l)")
