"""vendor.cuda moe_experts: torch's own grouped GEMM (``torch._grouped_mm``, CUTLASS on sm90+ for bf16).

Pairs (token, slot) are sorted by expert (stable, on the device), the tokens gathered, then two grouped
GEMMs over the per-expert row ranges (``offs``: cumulative row ends) with SiLU-and-mul between them,
the routing weight applied per row, and the k slots of each token summed in float32. The routing is used
as given: the router's ids and weights already hold its per-expert scale and bias. ``torch._grouped_mm`` is private:
``load`` resolves it for real and checks that a CUDA kernel is registered and the device is sm90 or newer, so a torch
that renames or drops it makes this implementation "unavailable", never a start-up crash.

Registered in ``turnout/ops/vendors/cuda/__init__.py`` with ``below=("triton",)``: the conformance
suite checks it, but it lost to the Triton paths at every batch size (docs/benchmarks.md, "MoE experts
kernel alone"), so it runs only where Triton is unavailable or denied, or when the policy names it
(``TURNOUT_OPS="moe_experts=vendor.cuda|triton"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turnout.ops.spec import ImplUnavailable

MIN_CAPABILITY = (9, 0)


def _grouped_mm_op():
    """The real callable, or ImplUnavailable with why (not ``hasattr``, which lazy namespaces fool)."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None or not callable(fn):
        raise ImplUnavailable(f"torch {torch.__version__} has no torch._grouped_mm")
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if has_kernel is not None and not has_kernel("aten::_grouped_mm", "CUDA"):
        raise ImplUnavailable(f"torch {torch.__version__}: aten::_grouped_mm has no CUDA kernel")
    return fn


def check(platform=None) -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    if getattr(torch.version, "hip", None):
        return False, "ROCm build: torch._grouped_mm is a slow fallback there"
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return False, f"device capability sm{cap[0]}{cap[1]} < sm90 (no CUTLASS grouped GEMM)"
    return True, f"torch._grouped_mm on sm{cap[0]}{cap[1]}"


def load():
    """Factory: returns ``moe_experts`` once torch._grouped_mm resolved for real on an sm90+ device."""
    _grouped_mm_op()
    ok, why = check()
    if not ok:
        raise ImplUnavailable(why)
    return moe_experts


def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """See turnout/ops/reference/moe.py for the contract."""
    grouped_mm = torch._grouped_mm
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()  # [N]
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)  # ids held elsewhere sort last, past every group
    order = torch.argsort(key, stable=True)  # [N] pair indices grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.long, device=hidden.device)
    counts.scatter_add_(0, key.clamp(max=num_experts - 1), valid.long())
    offs = torch.cumsum(counts, 0).to(torch.int32)  # [E] row ends; rows past offs[-1] are not computed
    x = hidden.index_select(0, order // top_k)  # [N, H], rows in expert order
    # w13[e] is [2I, H]: its transpose is the column-major [H, 2I] operand the CUTLASS path wants.
    gate_up = grouped_mm(x, w13.transpose(1, 2), offs=offs)  # [N, 2I]
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [N, I]
    y = grouped_mm(act.contiguous(), w2.transpose(1, 2), offs=offs)  # [N, H]
    w = topk_weights.reshape(-1).float()[order]
    y = torch.where(valid[order].unsqueeze(-1), y.float() * w.unsqueeze(-1), 0.0)  # uncomputed rows -> 0
    pair_out = torch.empty_like(y).index_copy_(0, order, y)  # back to pair order [N, H]
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)

