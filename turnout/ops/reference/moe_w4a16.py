"""moe_experts_w4a16: the routed experts with 4-bit weights (the w4a16 layout, turnout/ops/reference/w4a16.py), given
the routing (never recomputing it).

Each expert's gate/up is one w4a16 weight [2I, H] (the gate's rows, then the up's, each whole 64-row blocks) and its
down one [H, I]; the stacks hold them expert by expert:

* ``w13_qweight`` uint8 [E, 2I, H/2], ``w13_scale_zeros`` [E, H/G, 2I, 2];
* ``w2_qweight`` uint8 [E, H, I/2], ``w2_scale_zeros`` [E, I/G, H, 2];
* ``w13_perm`` [E, H] / ``w2_perm`` [E, I] int64 or None: activation order (GPTQ ``desc_act``), per expert (each
  expert has its own Hessian; the gate and the up of one expert read one input, so they share one order).

One group size G for every stack. The reference dequantises each expert in float32 and computes the float
``moe_experts`` (turnout/ops/reference/moe.py) on the dequantised weights: the exact value of the dequantised model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turnout.ops.reference._util import randint, randn
from turnout.ops.reference.moe import _routing
from turnout.ops.reference.w4a16 import dequantize_w4, random_w4
from turnout.ops.spec import OpSpec, SampleCase
from turnout.ops.w4_layout import check_experts


def dequantize_expert(qweight: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
                      perm: torch.Tensor | None) -> torch.Tensor:
    """One expert's float32 weight [N, K] in the input's column order (activation order undone)."""
    w = dequantize_w4(qweight, scale_zeros, group_size)
    return w if perm is None else torch.empty_like(w).index_copy_(1, perm.long(), w)


def moe_experts_w4a16(hidden: torch.Tensor, w13_qweight: torch.Tensor, w13_scale_zeros: torch.Tensor,
                      w2_qweight: torch.Tensor, w2_scale_zeros: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, group_size: int, w13_perm: torch.Tensor | None = None,
                      w2_perm: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) with the experts' 4-bit weights
    (layout above); ids outside [0, E) contribute nothing. float32 arithmetic, the result in hidden's dtype."""
    if hidden.dim() != 2:
        raise ValueError(f"moe_experts_w4a16 takes hidden [T, H], got {tuple(hidden.shape)}")
    num_experts, inter = check_experts(hidden.shape[1], w13_qweight, w13_scale_zeros, w2_qweight, w2_scale_zeros,
                                       group_size, w13_perm, w2_perm)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
    ids = topk_ids.long()
    x = hidden.float()
    for e in range(num_experts):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        w13 = dequantize_expert(w13_qweight[e], w13_scale_zeros[e], group_size,
                                None if w13_perm is None else w13_perm[e])  # [2I, H]
        w2 = dequantize_expert(w2_qweight[e], w2_scale_zeros[e], group_size,
                               None if w2_perm is None else w2_perm[e])  # [H, I]
        gate_up = x[tokens] @ w13.T  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (act @ w2.T) * topk_weights[tokens, slots].float().unsqueeze(-1))
    return out.to(hidden.dtype)


# ---- declarations and sample inputs -----------------------------------------------------------------

def random_experts(e: int, h: int, i: int, group_size: int, dtype, device, gen, zeros: bool = True):
    """Random 4-bit expert stacks (w13_qweight, w13_scale_zeros, w2_qweight, w2_scale_zeros), values ~N(0, 1/K)."""
    w13 = [random_w4(2 * i, h, group_size, dtype, device, gen, zeros) for _ in range(e)]
    w2 = [random_w4(h, i, group_size, dtype, device, gen, zeros) for _ in range(e)]
    return (torch.stack([q for q, _ in w13]), torch.stack([s for _, s in w13]),
            torch.stack([q for q, _ in w2]), torch.stack([s for _, s in w2]))


def _perms(e: int, k: int, device, gen) -> torch.Tensor:
    return torch.stack([torch.randperm(k, generator=gen) for _ in range(e)]).to(device)


# (tokens, hidden, intermediate, experts, top_k, group, zero points, act order, label)
_SHAPES = [
    (1, 64, 64, 4, 2, 32, True, False, "decode"),
    (7, 128, 64, 4, 2, 64, False, False, "prefill_sym"),
    (12, 64, 128, 4, 3, 32, True, True, "ragged_actorder"),
    (3, 128, 128, 16, 4, 128, True, False, "many_experts"),  # most experts get no token
]


def _samples(device, dtype, gen):
    for t, h, i, e, k, g, zeros, perm, label in _SHAPES:
        stacks = random_experts(e, h, i, g, dtype, device, gen, zeros)
        weights, ids = _routing(t, e, k, device, gen)
        perms = (_perms(e, h, device, gen), _perms(e, i, device, gen)) if perm else (None, None)
        yield SampleCase(f"{label}_T{t}H{h}I{i}E{e}k{k}g{g}",
                         (randn((t, h), dtype, device, gen, 0.5), *stacks, weights, ids, g, *perms))
    # expert parallelism: ids of experts this rank does not hold (-1) contribute nothing
    t, h, i, e, k, g = 5, 64, 64, 8, 2, 64
    weights, ids = _routing(t, e, k, device, gen)
    ids = torch.where(randint(0, 2, (t, k), device, gen, torch.int32).bool(), torch.full_like(ids, -1), ids)
    yield SampleCase(f"remote_ids_T{t}E{e}k{k}", (randn((t, h), dtype, device, gen, 0.5),
                                                   *random_experts(e, h, i, g, dtype, device, gen), weights, ids, g))


MOE_EXPERTS_W4A16 = OpSpec(
    "moe_experts_w4a16", moe_experts_w4a16, _samples,
    tolerance={"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (6e-2, 3e-2)},
    doc="routed experts with 4-bit weights (w4a16 layout, group scales and zeros, activation order), SiLU-and-mul, "
        "weighted sum over the given top-k (routing is never recomputed)")
