import torch
import torch.nn.functional as F

from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] (gate then up) -> [T, I] = silu(gate) * up."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _samples(device, dtype, gen):
    for t, i in [(1, 64), (6, 96), (31, 256), (3, 1000)]:
        yield SampleCase(f"T{t}xI{i}", (randn((t, 2 * i), dtype, device, gen, 2.0),))


SILU_AND_MUL = OpSpec("silu_and_mul", silu_and_mul, _samples,
                      tolerance={"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)},
                      doc="SwiGLU activation: silu(x[:, :I]) * x[:, I:]")
