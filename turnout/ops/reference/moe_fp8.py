"""moe_experts_fp8: the routed experts with fp8 (e4m3fn) weights in 128 x 128 blocks .

The routing arguments and the expert are those of ``moe_experts`` (turnout/ops/reference/moe.py); the weights are
fp8 with float32 block scales in the layout of the block-quantised checkpoints (DeepSeek-V3, Qwen3-FP8: each
expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` with its ``weight_scale_inv``), stacked:

* ``w13 [E, 2I, H]`` fp8 (gate rows, then up rows), ``w13_scale [E, 2 ceil(I/128), ceil(H/128)]``: the gate's
  blocks, then the up's (each part has its own blocks, as the checkpoint stores them; for I a multiple of 128
  this is ceil(2I/128) blocks of the stacked rows);
* ``w2 [E, H, I]`` fp8, ``w2_scale [E, ceil(H/128), ceil(I/128)]``.

Activations are quantised dynamically as the block models quantise them (``quantize_fp8`` with group 128, per
token and 128-wide group of K): the hidden rows before gate/up, and each (token, slot) pair's SiLU-and-mul
output before down. The reference dequantises and computes in float32: the meaning, and the fallback where no
fp8 units exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turnout.ops.reference._util import randint, randn
from turnout.ops.reference.fp8 import BLOCK, FP8_MAX, _cdiv, dequantize_act, quantize_fp8, quantize_weight
from turnout.ops.spec import OpSpec, SampleCase


def check_shapes(hidden, w13, w13_scale, w2, w2_scale) -> None:
    """ValueError naming the tensor whose shape does not fit the others (the layouts above)."""
    e, two_i, h = w13.shape
    i = two_i // 2
    want = {"hidden": (hidden.shape[0], h), "w2": (e, h, i), "w13_scale": (e, 2 * _cdiv(i, BLOCK), _cdiv(h, BLOCK)),
            "w2_scale": (e, _cdiv(h, BLOCK), _cdiv(i, BLOCK))}
    for name, t in (("hidden", hidden), ("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"moe_experts_fp8: {name} {tuple(t.shape)}, expected {want[name]} for w13 "
                             f"{tuple(w13.shape)}")


def _blocks(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float32 value of an fp8 weight [N, K] with its [ceil(N/128), ceil(K/128)] block scales."""
    n, k = w.shape
    return w.float() * s.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def dequantize_experts(w13, w13_scale, w2, w2_scale, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e``'s float32 [2I, H] (gate rows, then up rows) and [H, I]."""
    i = w13.shape[1] // 2
    nb = _cdiv(i, BLOCK)
    gate_up = torch.cat([_blocks(w13[e, :i], w13_scale[e, :nb]), _blocks(w13[e, i:], w13_scale[e, nb:])])
    return gate_up, _blocks(w2[e], w2_scale[e])


def moe_experts_fp8(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                    w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]), fp8 weights and activations.

    expert_e(x) = W2_e q(silu(W1_e q(x)) * (W3_e q(x))), W the dequantised blocks, q the per-token, per-128-group
    activation quantisation (``quantize_fp8(., 128)``, dequantised). Ids outside [0, E) contribute nothing; the
    weighted sum is float32, the result has hidden's dtype, the routing is used exactly as given."""
    check_shapes(hidden, w13, w13_scale, w2, w2_scale)
    num_tokens, hidden_size = hidden.shape
    inter = w13.shape[1] // 2
    x = dequantize_act(*quantize_fp8(hidden, BLOCK))  # [T, H] float32
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for e in range(w13.shape[0]):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up_w, down_w = dequantize_experts(w13, w13_scale, w2, w2_scale, e)
        gate_up = x[tokens] @ gate_up_w.t()  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I] float32
        y = dequantize_act(*quantize_fp8(act, BLOCK)) @ down_w.t()  # [n, H]
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float().unsqueeze(-1))
    return out.to(hidden.dtype)


# ---- tolerance --------------------------------------------------------------------------------------
# An implementation's float32 sums differ from the reference's: on the CPU by float32 rounding, on sm90 fp8 matrix
# units by their ~14-bit accumulation within a 128-wide K tile (ops/reference/fp8.py: _FP8_ACC). Through down that
# costs up to ACC * sum |a w|, as in compare_fp8_mm. Through gate/up it moves an activation by a little, which can
# round it to the neighbouring fp8 value where it lies near a rounding midpoint: one e4m3 step (up to 1/8 of it) of
# that element, times its column of down. The bound counts that step for exactly the elements whose distance to a
# midpoint is within their possible error, so it stays tight: a wrong scale, group or block moves whole outputs.
_ACC = {"cpu": 2.0 ** -16}  # float32 sums of at most a few thousand products; elsewhere the matrix units' bound
_ACC_MATRIX_UNITS = 2.0 ** -11
_TOL = {"float32": (2e-4, 2e-4), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}


def _e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """The spacing of the e4m3fn values around |v| (2^(e-3) in the binade of v, 2^-9 among the subnormals)."""
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -6)))
    return torch.exp2(e - 3)


def _flip_allowance(act: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """For pair activations ``act`` [n, I] (float64) known to within ``err``: per element, the change of its
    dequantised fp8 value if its rounding can differ (one step times its scale), else 0; plus what a moved group
    scale does to every element of its group."""
    n, i = act.shape
    g = _cdiv(i, BLOCK)
    pad = g * BLOCK - i
    a = F.pad(act, (0, pad)).view(n, g, BLOCK)
    d = F.pad(err, (0, pad)).view(n, g, BLOCK)
    amax = a.abs().amax(dim=2, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=2.0 ** -40)
    rho = d.amax(dim=2, keepdim=True) / amax.clamp(min=2.0 ** -40)  # relative change of the group's scale
    q = (a / scale).abs()
    dq = d / scale + q * rho  # how far the implementation's x / scale may be from the reference's
    step = _e4m3_step(q)
    frac = q / step - torch.floor(q / step)
    near = (frac - 0.5).abs() * step <= dq
    allowance = torch.where(near, step, torch.zeros_like(step)) * scale + rho * a.abs() * 1.01
    return allowance.view(n, g * BLOCK)[:, :i]


def compare_moe_fp8(ref: list, got: list, case) -> tuple[bool, float, str]:
    """|got - ref| <= atol + rtol |ref| + sum over the pairs of |weight| (ACC sum |a w2| + the flip allowance of
    its activations times |w2|); see the comment above."""
    hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids = case.args
    atol, rtol = _TOL[str(hidden.dtype).removeprefix("torch.")]
    if len(got) != 1 or got[0].shape != ref[0].shape or got[0].dtype != ref[0].dtype:
        return False, float("inf"), f"got {[(g.dtype, tuple(g.shape)) for g in got]}, expected " \
                                    f"{[(r.dtype, tuple(r.shape)) for r in ref]}"
    acc = _ACC.get(hidden.device.type, _ACC_MATRIX_UNITS)
    args = [t.cpu() for t in (hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)]
    hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids = args
    inter = w13.shape[1] // 2
    x = dequantize_act(*quantize_fp8(hidden, BLOCK)).double()
    slack = torch.zeros(hidden.shape, dtype=torch.float64)
    ids = topk_ids.long()
    for e in range(w13.shape[0]):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up_w, down_w = (w.double() for w in dequantize_experts(w13, w13_scale, w2, w2_scale, e))
        xs = x[tokens]
        gu, mags = xs @ gate_up_w.t(), xs.abs() @ gate_up_w.abs().t()
        gate, up = gu[:, :inter], gu[:, inter:]
        sig = torch.sigmoid(gate)
        d_silu = (sig * (1 + gate * (1 - sig))).abs()
        err = 2 * acc * (d_silu * mags[:, :inter] * up.abs() + (gate * sig).abs() * mags[:, inter:])
        act = gate * sig * up
        a_deq = dequantize_act(*quantize_fp8(act.float(), BLOCK)).double()
        extra = (acc * a_deq.abs() + _flip_allowance(act, err)) @ down_w.abs().t()  # [n, H]
        slack.index_add_(0, tokens, extra * topk_weights[tokens, slots].double().abs().unsqueeze(-1))
    r, g = ref[0].cpu().double(), got[0].cpu().double()
    err = (r - g).abs()
    worst = err.max().item() if err.numel() else 0.0
    if torch.isnan(g).any() or (err > atol + rtol * r.abs() + slack).any():
        return False, worst, f"max error {worst:.3g} beyond atol={atol} rtol={rtol} + accumulation and fp8 " \
                             "rounding flips of the activations"
    return True, worst, ""


# ---- sample inputs ----------------------------------------------------------------------------------
# (tokens, hidden, intermediate, experts, top_k, label): the Triton paths by size (one token; decode, a program per
# expert; decode, a program per slot; the sorted grouped GEMM beyond 128 pairs), H / I off the 128 grid, and several
# activation groups. Few, as the interpreter runs them (tests/moe/test_moe_fp8.py forces each path on more).
_SHAPES = [
    (1, 256, 128, 4, 2, "one_token"),
    (5, 256, 128, 4, 2, "decode"),
    (2, 128, 256, 8, 3, "by_slot"),
    (80, 256, 128, 4, 2, "grouped"),
    (6, 200, 80, 8, 3, "ragged"),
]


def _expert_weight(e: int, n: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """[e, n, k] fp8 and its block scales; blocks of very different magnitudes, so a wrong block shows."""
    qs, ss = [], []
    for _ in range(e):
        spread = torch.exp2(torch.rand(_cdiv(n, BLOCK), _cdiv(k, BLOCK), generator=gen) * 2 - 1)  # 0.5 .. 2
        w = torch.randn(n, k, generator=gen) * k ** -0.5 * spread.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(
            BLOCK, 1)[:, :k]
        q, s = quantize_weight(w, "block")
        qs.append(q)
        ss.append(s)
    return torch.stack(qs), torch.stack(ss)


def make_experts(e: int, h: int, i: int, gen, device) -> tuple[torch.Tensor, ...]:
    """(w13, w13_scale, w2, w2_scale) of ``e`` random experts: gate and up each with their own blocks."""
    gate, gs = _expert_weight(e, i, h, gen)
    up, us = _expert_weight(e, i, h, gen)
    w2, w2s = _expert_weight(e, h, i, gen)
    return tuple(t.to(device) for t in (torch.cat([gate, up], 1), torch.cat([gs, us], 1), w2, w2s))


def _hidden(t: int, h: int, dtype, device, gen) -> torch.Tensor:
    """Rows whose 128-groups differ in magnitude (a wrong activation group shows)."""
    spread = torch.exp2(torch.rand(t, _cdiv(h, BLOCK), generator=gen) * 2 - 1).repeat_interleave(BLOCK, 1)[:, :h]
    return (randn((t, h), torch.float32, "cpu", gen) * spread).to(device=device, dtype=dtype)


def _routing(t, e, k, device, gen):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand((t, k), generator=gen) * 2.0 + 0.05
    return weights.to(device=device, dtype=torch.float32), ids.to(device=device, dtype=torch.int32)


def _samples(device, dtype, gen):
    for t, h, i, e, k, label in _SHAPES:
        weights, ids = _routing(t, e, k, device, gen)
        yield SampleCase(f"{label}_T{t}H{h}I{i}E{e}k{k}",
                         (_hidden(t, h, dtype, device, gen), *make_experts(e, h, i, gen, device), weights, ids))
    # expert parallelism: ids of experts this rank does not hold (-1) contribute nothing
    t, h, i, e, k = 9, 128, 128, 4, 3
    weights, ids = _routing(t, e, k, device, gen)
    ids = torch.where(randint(0, 2, (t, k), device, gen, torch.int32).bool(), torch.full_like(ids, -1), ids)
    yield SampleCase(f"remote_ids_T{t}E{e}k{k}",
                     (_hidden(t, h, dtype, device, gen), *make_experts(e, h, i, gen, device), weights, ids))


MOE_EXPERTS_FP8 = OpSpec(
    "moe_experts_fp8", moe_experts_fp8, _samples, tolerance=_TOL, compare=compare_moe_fp8,
    doc="routed experts with fp8 weights in 128x128 blocks, activations per token and 128 group (routing as given)")
