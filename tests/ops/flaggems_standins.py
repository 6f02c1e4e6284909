"""Stand-ins for the FlagGems 5.0.2 functions turnout's FlagGems plugin calls, for machines where FlagGems
cannot run (its import needs a device).

Each has FlagGems' signature, the checks FlagGems makes (the asserts of its Python entry points), and its
addressing where that is what a wrapper must adapt to (``fused_add_rms_norm`` writes into ``.contiguous()``
copies; ``reshape_and_cache_flash`` reads a token's heads as one dense row). The arithmetic is turnout's
reference wherever FlagGems computes the same thing, so a wrapper that maps its arguments correctly gives
the reference's result, and a wrong mapping (a window off by one, the full head passed for a partial rotary,
per-token scales where FlagGems wants groups, an id of another rank's expert) fails or raises.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from turnout.ops.reference import attention, fp8, moe, moe_fp8, norm, rotary, routing


class StandIns:
    """The flag_gems namespace the wrappers see (``gems=``); ``calls`` counts the calls of each function."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def rms_norm(self, x, normalized_shape, weight, eps=1e-5):
        self._count("rms_norm")
        assert list(normalized_shape) == [x.shape[-1]] and weight.shape == (x.shape[-1],)
        return norm.rms_norm(x.contiguous(), weight, eps)

    def fused_add_rms_norm(self, x, residual, normalized_shape, weight, eps=1e-5):
        self._count("fused_add_rms_norm")
        assert list(normalized_shape) == [x.shape[-1]]
        x, residual = x.contiguous(), residual.contiguous()  # as FlagGems: a strided argument is a copy
        norm.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul_out(self, a, b, out):
        self._count("silu_and_mul_out")
        assert a.shape == b.shape == out.shape
        out.copy_((F.silu(a.float()) * b.float()).to(out.dtype))
        return out

    def apply_rotary_pos_emb(self, q, k, cos, sin, position_ids=None, rotary_interleaved=False, inplace=False):
        self._count("apply_rotary_pos_emb")
        assert k.shape[-1] == q.shape[-1] and cos.shape[-1] * 2 == q.shape[-1]
        assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and inplace
        assert position_ids is not None and position_ids.shape == q.shape[:-2]
        q3, k3 = q.view(-1, q.shape[-2], q.shape[-1]), k.view(-1, k.shape[-2], k.shape[-1])  # as FlagGems does
        rotary.rotary_embedding(position_ids, q3, k3, torch.cat([cos, sin], dim=-1), not rotary_interleaved)
        return q, k

    def reshape_and_cache_flash(self, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                                v_scale):
        self._count("reshape_and_cache_flash")
        assert kv_cache_dtype == "auto" and key_cache.stride(0) == value_cache.stride(0)
        t, h, d = key.shape
        nb, bs = key_cache.shape[:2]
        for src, dst in ((key, key_cache), (value, value_cache)):
            # its kernel: token t's H * D values start at t * stride(0) and are read as one dense row, and
            # written at block * block_stride + offset * H * D
            rows = src.as_strided((t, h * d), (src.stride(0), 1))
            blocks = dst.as_strided((nb, bs, h * d), (dst.stride(0), h * d, 1))
            keep = slot_mapping >= 0
            slots = slot_mapping[keep].long()
            blocks[slots // bs, slots % bs] = rows[keep]

    def flash_attn_varlen_func(self, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                               seqused_k=None, q_v=None, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=None, softcap=0.0, alibi_slopes=None, deterministic=False,
                               return_attn_probs=False, block_table=None, return_softmax_lse=False, out=None,
                               **fa3):
        self._count("flash_attn_varlen_func")
        assert q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype
        assert block_table is not None and seqused_k is not None and cu_seqlens_k is None
        assert cu_seqlens_q.dtype == torch.int32 and seqused_k.dtype == torch.int32 and causal
        assert q.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and not fa3.get("s_aux")
        left, right = (-1, -1) if window_size is None else window_size
        assert right in (-1, 0)
        # FlashAttention keeps keys [p - left, p] (inclusive); turnout's window W keeps p - W < j <= p
        window = None if left < 0 else left + 1
        return attention.paged_attention(q, k, v, block_table, seqused_k, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                                         softmax_scale or 1 / math.sqrt(q.shape[-1]), sliding_window=window,
                                         logit_softcap=softcap if softcap > 0 else None)

    def topk_softmax(self, topk_weights, topk_indices, token_expert_indices, gating_output, renormalize=False):
        self._count("topk_softmax")
        assert topk_weights.dtype == torch.float32 and topk_indices.dtype in (torch.int32, torch.int64)
        w, ids = routing.select_experts(gating_output, topk_weights.shape[-1], "softmax", False, 1, 1, renormalize,
                                        1.0)
        topk_weights.copy_(w)
        topk_indices.copy_(ids)

    def grouped_topk(self, scores, n_group, topk_group, topk, renormalize, routed_scaling_factor, bias,
                     scoring_func=0):
        """FlagGems' semantics: scores (sigmoid of them for scoring_func 1) choose with the bias added; groups
        ranked by the sum of their top-2 biased scores; weights the unbiased scores, renormalised (+1e-20),
        times the scaling factor."""
        self._count("grouped_topk")
        assert scores.ndim == 2 and scores.shape[1] % n_group == 0 and topk & (topk - 1) == 0 and topk <= 32
        assert scoring_func in (0, 1) and bias is not None and bias.shape == (scores.shape[1],)
        t, e = scores.shape
        s = torch.sigmoid(scores.float()) if scoring_func == 1 else scores.float()
        choice = (s + bias.float()).view(t, n_group, e // n_group)
        _, kept = routing.stable_topk(choice.topk(2, dim=-1).values.sum(-1), topk_group)
        mask = torch.zeros(t, n_group, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(t, e)
        _, ids = routing.stable_topk(choice, topk)
        w = s.gather(1, ids)
        if renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * routed_scaling_factor, ids.to(torch.int32)

    def fused_experts_impl(self, hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, activation="silu",
                           use_fp8_w8a8=False, w1_scale=None, w2_scale=None, block_shape=None, **rest):
        self._count("fused_experts_impl")
        assert activation == "silu" and hidden_states.is_contiguous() and topk_weights.shape == topk_ids.shape
        e = w1.shape[0]
        assert bool(((topk_ids >= 0) & (topk_ids < e)).all()), "FlagGems indexes every id it is given"
        if not use_fp8_w8a8:
            return moe.moe_experts(hidden_states, w1, w2, topk_weights, topk_ids)
        n, k = w1.shape[1], w1.shape[2]
        assert block_shape == [128, 128] and k % 128 == 0  # its activation quantisation needs whole groups
        assert w1_scale.shape == (e, -(-n // 128), -(-k // 128))  # ceil(2I/128): gate and up blocks together
        return moe_fp8.moe_experts_fp8(hidden_states, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids)

    def per_token_group_quant_fp8(self, x, group_size, eps=1e-10, dtype=None, column_major_scales=False,
                                  scale_ue8m0=False):
        self._count("per_token_group_quant_fp8")
        assert x.shape[-1] % group_size == 0 and x.stride(-1) == 1 and not column_major_scales
        m, k = x.shape
        g = x.float().view(m, k // group_size, group_size)
        scale = g.abs().amax(-1).clamp(min=eps) / fp8.FP8_MAX
        q = (g / scale.unsqueeze(-1)).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(dtype or fp8.FP8).view(m, k)
        return q, scale

    def cutlass_scaled_mm(self, c, a, b, a_scale, b_scale, bias=None):
        self._count("cutlass_scaled_mm")
        assert a.stride(1) == 1 and c.stride(1) == 1 and b.stride(0) == 1, "b must be column-major"
        assert c.stride(0) % 16 == 0 and b.stride(1) % 16 == 0 and a.shape[1] == b.shape[0]
        assert a_scale.numel() == a.shape[0] and b_scale.numel() == b.shape[1]
        y = (a.float() * a_scale.view(-1, 1)) @ (b.float() * b_scale.view(1, -1))
        c.copy_((y if bias is None else y + bias.float()).to(c.dtype))
        return c

    def w8a8_block_fp8_matmul(self, A, B, As, Bs, block_size, output_dtype=torch.float16):
        self._count("w8a8_block_fp8_matmul")
        assert block_size == [128, 128] and A.is_contiguous() and A.shape[:-1] == As.shape[:-1]
        assert -(-A.shape[-1] // 128) == As.shape[-1], "As: one scale per row and 128 group"
        return fp8.block_scaled_mm(A, As, B, Bs, None, output_dtype)
