import torch

from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; weight: [H]. Normalise in float32, cast back to x's dtype, then scale (as HF Llama)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual <- x + residual; x <- rms_norm(residual). Both [T, H]."""
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))


def _samples(device, dtype, gen):
    for t, h in [(1, 64), (7, 128), (33, 96), (5, 1000)]:
        yield SampleCase(f"T{t}xH{h}", (randn((t, h), dtype, device, gen), randn((h,), dtype, device, gen, 0.5) + 1,
                                        1e-6))


def _fused_samples(device, dtype, gen):
    for t, h in [(1, 64), (9, 128), (17, 1000)]:
        yield SampleCase(f"T{t}xH{h}", (randn((t, h), dtype, device, gen), randn((t, h), dtype, device, gen),
                                        randn((h,), dtype, device, gen, 0.5) + 1, 1e-5))


_TOL = {"float32": (1e-5, 1e-5), "float16": (1e-2, 1e-2), "bfloat16": (6e-2, 2e-2)}

RMS_NORM = OpSpec("rms_norm", rms_norm, _samples, tolerance=_TOL,
                  doc="RMSNorm: weight * (x / sqrt(mean(x^2) + eps)), computed in float32")
FUSED_ADD_RMS_NORM = OpSpec("fused_add_rms_norm", fused_add_rms_norm, _fused_samples,
                            mutates=("x", "residual"), tolerance=_TOL,
                            doc="residual += x; x = rms_norm(residual), in place")
