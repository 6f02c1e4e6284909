"""moe_experts: the routed experts of a MoE layer, given the routing (never recomputing it)."""

import torch
import torch.nn.functional as F

from turnout.ops.reference._util import randint, randn
from turnout.ops.spec import OpSpec, SampleCase


def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]).

    hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights fp32 [T, k];
    topk_ids int32 [T, k]. expert_e(x) = w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)). Ids outside
    [0, E) contribute nothing (experts held by another rank). The weighted sum is accumulated in float32;
    the result has hidden's dtype. The weights and ids are used exactly as given.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)  # [T, H]
    ids = topk_ids.long()
    for e in range(num_experts):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = hidden[tokens] @ w13[e].t()  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        y = act @ w2[e].t()  # [n, H]
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots].float().unsqueeze(-1))
    return out.to(hidden.dtype)


# (tokens, hidden, intermediate, experts, top_k, label)
_SHAPES = [
    (1, 32, 16, 4, 2, "decode"),
    (7, 64, 32, 8, 2, "prefill"),
    (33, 48, 80, 16, 4, "ragged"),  # H, I not multiples of the kernel tiles
    (5, 32, 48, 64, 6, "many_experts"),  # most experts get no token
]


def _routing(num_tokens, num_experts, top_k, device, gen):
    """Random distinct ids per token and positive weights that do not sum to 1 (as after scaling)."""
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand((num_tokens, top_k), generator=gen) * 2.0 + 0.05
    return weights.to(device=device, dtype=torch.float32), ids.to(device=device, dtype=torch.int32)


def _samples(device, dtype, gen):
    for t, h, i, e, k, label in _SHAPES:
        hidden = randn((t, h), dtype, device, gen)
        w13 = randn((e, 2 * i, h), dtype, device, gen, h ** -0.5)
        w2 = randn((e, h, i), dtype, device, gen, i ** -0.5)
        weights, ids = _routing(t, e, k, device, gen)
        yield SampleCase(f"{label}_T{t}H{h}I{i}E{e}k{k}", (hidden, w13, w2, weights, ids))
    # expert parallelism: ids of experts this rank does not hold (-1) contribute nothing
    t, h, i, e, k = 9, 32, 32, 8, 3
    weights, ids = _routing(t, e, k, device, gen)
    drop = randint(0, 2, (t, k), device, gen, torch.int32).bool()
    ids = torch.where(drop, torch.full_like(ids, -1), ids)
    yield SampleCase(f"remote_ids_T{t}E{e}k{k}", (randn((t, h), dtype, device, gen),
                                                   randn((e, 2 * i, h), dtype, device, gen, h ** -0.5),
                                                   randn((e, h, i), dtype, device, gen, i ** -0.5), weights, ids))


MOE_EXPERTS = OpSpec(
    "moe_experts", moe_experts, _samples,
    tolerance={"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (6e-2, 3e-2)},
    doc="routed experts with SiLU-and-mul, weighted sum over the given top-k (routing is never recomputed)")
