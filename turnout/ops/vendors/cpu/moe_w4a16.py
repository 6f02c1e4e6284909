"""moe_experts_w4a16 on the CPU (layout: turnout/ops/reference/moe_w4a16.py): each expert that has tokens runs its
gate/up and its down through the CPU ``w4a16_linear`` (turnout/ops/vendors/cpu/w4a16.py), which reads the packed
4-bit blocks directly (torch's int4 kernel for bfloat16; 64-row slabs dequantised into cache for float32 / float16),
so no expert is ever held in float. The weighted sum over the slots is accumulated in float32. ``experts_over``
builds the same loop over another ``w4a16_linear`` (vendor.cpu_native's, turnout/ops/vendors/cpu/native.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turnout.ops.vendors.cpu.w4a16 import w4a16_linear
from turnout.ops.w4_layout import check_experts


def experts_over(w4a16_linear):
    """moe_experts_w4a16 with each expert's projections through ``w4a16_linear``."""

    def moe_experts_w4a16(hidden: torch.Tensor, w13_qweight: torch.Tensor, w13_scale_zeros: torch.Tensor,
                          w2_qweight: torch.Tensor, w2_scale_zeros: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, group_size: int, w13_perm: torch.Tensor | None = None,
                          w2_perm: torch.Tensor | None = None) -> torch.Tensor:
        """See turnout/ops/reference/moe_w4a16.py."""
        if hidden.dim() != 2:
            raise ValueError(f"moe_experts_w4a16 takes hidden [T, H], got {tuple(hidden.shape)}")
        num_experts, inter = check_experts(hidden.shape[1], w13_qweight, w13_scale_zeros, w2_qweight,
                                           w2_scale_zeros, group_size, w13_perm, w2_perm)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
        ids = topk_ids.long()
        # the experts with tokens, found with one host sync (a loop over all E would cost E masks)
        active = torch.unique(ids[(ids >= 0) & (ids < num_experts)]).tolist()
        for e in active:
            tokens, slots = (ids == e).nonzero(as_tuple=True)
            x = hidden.index_select(0, tokens)  # [n, H]
            gate_up = w4a16_linear(x, w13_qweight[e], w13_scale_zeros[e], group_size,
                                   None if w13_perm is None else w13_perm[e])  # [n, 2I]
            act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(hidden.dtype)
            y = w4a16_linear(act, w2_qweight[e], w2_scale_zeros[e], group_size,
                             None if w2_perm is None else w2_perm[e])
            out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots].float().unsqueeze(-1))
        return out.to(hidden.dtype)

    return moe_experts_w4a16


moe_experts_w4a16 = experts_over(w4a16_linear)
