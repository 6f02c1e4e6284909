"""Gated activations over [T, 2I] (gate then up) -> [T, I]: SwiGLU (silu), GeGLU (gelu, tanh approximation) and
GPT-OSS's clamped SwiGLU. One program per (row, block of I)."""

import torch
import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_args, pdl_wait

# gelu_tanh(g) = 0.5 g (1 + tanh(c (g + 0.044715 g^3))) = g * sigmoid(2 c (g + 0.044715 g^3)), c = sqrt(2 / pi):
# the sigmoid form needs only exp, and stays finite for any g (exp overflow gives 1 / inf = 0).
_TWO_C = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi)


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


@triton.jit
def _act_and_mul_kernel(X, OUT, stride_x, stride_o, I, alpha, limit, ACT: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + I + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    u = up.to(tl.float32)
    if ACT == 1:  # gelu, tanh approximation; rounded to the input dtype before the product, as torch does
        inner = _TWO_C * (g + 0.044715 * g * g * g)
        a = (g / (1.0 + tl.exp(-inner))).to(gate.dtype).to(tl.float32)
        out = a * u
    else:  # clamped swiglu (GPT-OSS), in float32 throughout
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    tl.store(OUT + row * stride_o + offs, out.to(OUT.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, act: int, alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """act 0: silu (its own kernel, the hot one of every Llama-shaped model, left without the others' arguments);
    1: gelu-tanh; 2: clamped swiglu."""
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
    if act == 0:
        _silu_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block, num_warps=4,
                                   **pdl_args(x2))
        return out
    _act_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), d, float(alpha), float(limit), ACT=act,
                              BLOCK=block, num_warps=4, **pdl_args(x2))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, 0)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, 1)


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return _act_and_mul(x, 2, alpha, limit)
