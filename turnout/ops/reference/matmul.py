"""linear: y = x W^T (+ b) for any number of rows, as an op (the batch-invariant mode's projections).

Outside batch-invariant mode the layers call ``F.linear`` themselves and never this op; in that mode every
projection goes through it (``FusionPlan.all_linear``, turnout/layers/fusion.py), so that a platform can
supply a GEMM whose reduction order does not depend on the number of rows.
"""

import torch
import torch.nn.functional as F

from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> [..., N] in x's dtype (``F.linear``)."""
    return F.linear(x, weight, bias)


def _samples(device, dtype, gen):
    # (M, N, K, bias): one row, a few, a prefill chunk, sizes off every tile multiple.
    for m, n, k, bias in [(1, 64, 96, False), (3, 70, 130, True), (17, 48, 64, False), (64, 33, 200, True),
                          (100, 130, 72, False)]:
        b = randn((n,), dtype, device, gen) if bias else None
        yield SampleCase(f"M{m}N{n}K{k}{'_bias' if bias else ''}",
                         (randn((m, k), dtype, device, gen), randn((n, k), dtype, device, gen, k ** -0.5), b))


LINEAR = OpSpec(
    "linear", linear, _samples,
    tolerance={"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)},
    doc="y = x W^T (+ b), any number of rows (every projection in batch-invariant mode)")
