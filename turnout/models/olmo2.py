"""OLMo 2: post-norms only (``post_attention_layernorm`` and ``post_feedforward_layernorm`` on each block's output,
no pre-norm), and q and k RMS-normed over the whole projection (all heads at once: ``q_norm`` [Hq D],
``k_norm`` [Hk D]) before rope, instead of per head. Tensor parallelism would split those norms' sums over the
ranks, which is not built: one rank only."""

import torch

from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.models.decoder import DecoderAttention, DecoderForCausalLM


class Olmo2Attention(DecoderAttention):
    """DecoderAttention with q and k normed over the whole projection, before they are split into heads."""

    takes_pending_norm = False  # post-norm layers hand it the stream itself

    def __init__(self, config, ops, rotary, make_norm, **kwargs):
        super().__init__(config, ops, rotary, qk_norm=False, **kwargs)
        self.q_norm = make_norm(self.num_heads * self.head_dim)
        self.k_norm = make_norm(self.num_kv_heads * self.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache, meta):
        t = hidden.shape[0]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.contiguous()).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_norm(k.contiguous()).view(t, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        return self.attend(positions, q, k, v.view(t, self.num_kv_heads, self.head_dim), kv_cache, meta)


class Olmo2ForCausalLM(DecoderForCausalLM):
    norm_placement = "post"
    supports_tensor_parallel = False
    no_tensor_parallel_reason = "its q/k norms span every head"

    def make_attention(self, config, layer_idx: int, ops, rotary, plan: FusionPlan = NO_FUSIONS):
        bias = bool(getattr(config, "attention_bias", False))
        return Olmo2Attention(config, ops, rotary, self.make_norm, qkv_bias=bias, o_bias=bias, plan=plan, tp=self.tp,
                              spec=self.attention_spec(config, layer_idx))
