"""moe_experts_biased: the routed experts with biased projections and a declared gated activation.

A variant of ``moe_experts`` (same routing contract, same weight layout) for experts whose two projections
carry a bias and whose gated unit is not plain SiLU-and-mul: GPT-OSS (``activation="clamped_swiglu"``). It is
an op of its own, not keywords on ``moe_experts``, so that only implementations that declare it can serve it:
the fast paths that cannot (the one-token decode kernels, the fp8 experts, torch's grouped GEMM) are simply not
candidates, and the op table falls back to one that computes this, never to one that would silently compute
plain SwiGLU without the biases.
"""

import torch
import torch.nn.functional as F

from turnout.ops.reference._util import randint, randn
from turnout.ops.reference.activation import clamped_swiglu
from turnout.ops.reference.moe import _routing
from turnout.ops.spec import OpSpec, SampleCase

ACTIVATIONS = ("silu", "clamped_swiglu")


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def moe_experts_biased(hidden: torch.Tensor, w13: torch.Tensor, w13_bias: torch.Tensor | None, w2: torch.Tensor,
                       w2_bias: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       activation: str = "clamped_swiglu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]).

    hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows) with w13_bias [E, 2I] or None; w2 [E, H, I] with
    w2_bias [E, H] or None; topk_weights fp32 [T, k]; topk_ids int32 [T, k]. expert_e(x) = w2[e] @ act(w13[e] @ x
    + w13_bias[e]) + w2_bias[e], act = ``silu`` (silu(gate) * up) or ``clamped_swiglu`` (GPT-OSS: turnout/ops/
    reference/activation.py, with ``alpha`` and ``limit``); the down bias is weighted with the rest of the
    expert's output. Ids outside [0, E) contribute nothing. The projections and the activation run in hidden's
    dtype (as HF's GptOssExperts does), the weighted sum in float32; the result has hidden's dtype.
    """
    check_activation(activation)
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
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e]
        if activation == "silu":
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        else:
            act = clamped_swiglu(gate_up, alpha, limit)
        y = act @ w2[e].t()  # [n, H]
        if w2_bias is not None:
            y = y + w2_bias[e]
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots].float().unsqueeze(-1))
    return out.to(hidden.dtype)


# (tokens, hidden, intermediate, experts, top_k, label)
_SHAPES = [
    (1, 32, 16, 4, 2, "decode"),
    (7, 64, 32, 8, 2, "prefill"),
    (33, 48, 80, 16, 4, "ragged"),  # H, I not multiples of the kernel tiles
    (5, 32, 48, 64, 6, "many_experts"),  # most experts get no token
]


def _samples(device, dtype, gen):
    for t, h, i, e, k, label in _SHAPES:
        # weights scaled so that a good share of the gate / up values pass the clamp limit of 7 on either side
        hidden = randn((t, h), dtype, device, gen, 2.0)
        w13 = randn((e, 2 * i, h), dtype, device, gen, 3.0 * h ** -0.5)
        b13 = randn((e, 2 * i), dtype, device, gen, 2.0)
        # the clamped unit's outputs reach ~60: a small down projection keeps the result O(1), where the
        # tolerances of a half-precision comparison mean something
        w2 = randn((e, h, i), dtype, device, gen, 0.05 * i ** -0.5)
        b2 = randn((e, h), dtype, device, gen)
        weights, ids = _routing(t, e, k, device, gen)
        yield SampleCase(f"{label}_T{t}H{h}I{i}E{e}k{k}", (hidden, w13, b13, w2, b2, weights, ids),
                         {"activation": "clamped_swiglu", "alpha": 1.702, "limit": 7.0})
    t, h, i, e, k = 6, 32, 32, 8, 2
    weights, ids = _routing(t, e, k, device, gen)
    # silu with biases, and the clamped unit without them (each bias may be absent: None)
    yield SampleCase(f"silu_biased_T{t}E{e}k{k}", (randn((t, h), dtype, device, gen),
                                                    randn((e, 2 * i, h), dtype, device, gen, h ** -0.5),
                                                    randn((e, 2 * i), dtype, device, gen),
                                                    randn((e, h, i), dtype, device, gen, i ** -0.5),
                                                    randn((e, h), dtype, device, gen), weights, ids),
                     {"activation": "silu"})
    yield SampleCase(f"no_bias_T{t}E{e}k{k}", (randn((t, h), dtype, device, gen, 2.0),
                                                randn((e, 2 * i, h), dtype, device, gen, 3.0 * h ** -0.5), None,
                                                randn((e, h, i), dtype, device, gen, 0.05 * i ** -0.5), None, weights, ids),
                     {"activation": "clamped_swiglu", "alpha": 1.5, "limit": 5.0})
    # expert parallelism: ids of experts this rank does not hold (-1) contribute nothing, their biases included
    t, h, i, e, k = 9, 32, 32, 8, 3
    weights, ids = _routing(t, e, k, device, gen)
    drop = randint(0, 2, (t, k), device, gen, torch.int32).bool()
    ids = torch.where(drop, torch.full_like(ids, -1), ids)
    yield SampleCase(f"remote_ids_T{t}E{e}k{k}", (randn((t, h), dtype, device, gen),
                                                   randn((e, 2 * i, h), dtype, device, gen, h ** -0.5),
                                                   randn((e, 2 * i), dtype, device, gen),
                                                   randn((e, h, i), dtype, device, gen, i ** -0.5),
                                                   randn((e, h), dtype, device, gen), weights, ids),
                     {"activation": "clamped_swiglu", "alpha": 1.702, "limit": 7.0})


MOE_EXPERTS_BIASED = OpSpec(
    "moe_experts_biased", moe_experts_biased, _samples,
    # float16 / bfloat16: the reference rounds the biased gate/up and the activation to the dtype at each step,
    # a kernel keeps them in float32; past the clamp (up + 1) spans a few ulps of the rounded operands
    tolerance={"float32": (1e-4, 1e-4), "float16": (2e-2, 2e-2), "bfloat16": (1.5e-1, 5e-2)},
    doc="routed experts with biased gate_up / down and a declared gated activation (silu, GPT-OSS's clamped "
        "SwiGLU), weighted sum over the given top-k (routing is never recomputed)")
