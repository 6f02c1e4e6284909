"""SwiGLU: silu(gate) * up over [T, 2I] -> [T, I]."""

import torch
import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_args, pdl_wait


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_o, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + I + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu rounds to the input dtype before the product, as torch does.
    s = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(OUT + row * stride_o + offs, (s * up.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    if x2.shape[0] == 0 or d == 0:
        return out
    block = min(triton.next_power_of_2(d), 1024)
    grid = (x2.shape[0], triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block, num_warps=4, **pdl_args(x2))
    return out
