"""vendor.cuda scaled_mm: torch's own fp8 GEMM (``torch._scaled_mm``, cuBLASLt / CUTLASS) with row-wise scales.

Row-wise scaling (x scale [M, 1], weight scale as [1, N]) needs sm90+ and a bfloat16 output; the weight
[N, K] row-major is the column-major [K, N] operand it wants, so nothing is copied. Shapes it does not take
(K or N not a multiple of 16, an output other than bfloat16) go to the reference, which is correct anywhere;
the models' projections are all bfloat16 multiples of 16. ``torch._scaled_mm`` is private: ``load`` resolves
it for real and checks the device, so a torch that renames it makes this implementation "unavailable" (the
Triton kernel or the reference then serves), never a start-up crash.
"""

from __future__ import annotations

import torch

from turnout.ops.spec import ImplUnavailable

MIN_CAPABILITY = (9, 0)


def check(platform=None) -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    if getattr(torch.version, "hip", None):
        return False, "ROCm build: e4m3fnuz, not the checkpoints' e4m3fn"
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return False, f"device capability sm{cap[0]}{cap[1]} < sm90 (row-wise scaled fp8 GEMM)"
    return True, f"torch._scaled_mm on sm{cap[0]}{cap[1]}"


def load():
    """Factory: ``scaled_mm`` once torch._scaled_mm resolved for real on an sm90+ device."""
    if not callable(getattr(torch, "_scaled_mm", None)):
        raise ImplUnavailable(f"torch {torch.__version__} has no torch._scaled_mm")
    ok, why = check()
    if not ok:
        raise ImplUnavailable(why)
    return scaled_mm


def scaled_mm(xq, x_scale, weight, weight_scale, bias=None, out_dtype=torch.bfloat16):
    """See turnout/ops/reference/fp8.py."""
    from turnout.ops.reference import fp8 as ref

    m, k = xq.shape
    n = weight.shape[0]
    if (out_dtype != torch.bfloat16 or k % 16 or n % 16 or m == 0 or x_scale.shape != (m, 1)
            or tuple(weight_scale.shape) != (n, 1)):
        return ref.scaled_mm(xq, x_scale, weight, weight_scale, bias, out_dtype)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.float().contiguous(),
                         scale_b=weight_scale.float().reshape(1, n).contiguous(), out_dtype=out_dtype)
    return y if bias is None else y.add_(bias.to(y.dtype))
