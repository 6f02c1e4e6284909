"""RMSNorm and fused residual-add + RMSNorm: one program per row, statistics in float32."""

import torch
import triton
import triton.language as tl

from turnout.ops.triton._pdl import pdl_args, pdl_wait


@triton.jit
def _rms_norm_kernel(X, W, OUT, stride_x, stride_o, H, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(W + offs, mask=mask, other=0.0)
    # Round the normalised value to x's dtype before scaling, as the reference (HF Llama) does.
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(OUT + row * stride_o + offs, y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(X, R, W, stride_x, stride_r, H, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to activations (turnout/ops/triton/_pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
    r = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
    tl.store(R + row * stride_r + offs, r, mask=mask)
    rf = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(rf * rf, axis=0) / H + eps)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = (rf * rstd).to(r.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(X + row * stride_x + offs, y.to(X.dtype.element_ty), mask=mask)


def _launch_params(h: int) -> tuple[int, int]:
    block = triton.next_power_of_2(h)
    return block, min(max(block // 256, 1), 16)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, H] view with a unit last stride (copies only if it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out2 = out.view(-1, h)
    if x2.shape[0] == 0:
        return out
    block, warps = _launch_params(h)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out2, x2.stride(0), out2.stride(0), h, eps, BLOCK=block,
                                     num_warps=warps, **pdl_args(x2))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    h = x.shape[-1]
    if x.stride(-1) != 1 or residual.stride(-1) != 1 or x.dim() != 2 or residual.dim() != 2:
        raise ValueError("fused_add_rms_norm needs 2-D x and residual with a unit last stride")
    if x.shape[0] == 0:
        return
    block, warps = _launch_params(h)
    _fused_add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, x.stride(0), residual.stride(0), h, eps,
                                               BLOCK=block, num_warps=warps, **pdl_args(x))
