"""The pre-norm decoder shared by Llama, Mistral, Qwen2, Qwen3 and the MoE families.

A model family is a subclass that sets a few class attributes:

- ``qkv_bias`` / ``o_bias``: ``None`` reads ``config.attention_bias``; a bool forces it (Qwen2: q/k/v
  biased, o_proj not).
- ``qk_norm``: RMSNorm over each head of q and k before rope (Qwen3, GLM-4 MoE with ``use_qk_norm``).
- ``rope_is_neox``: rotate halves (True) or interleaved pairs.
- ``make_mlp(config, layer_idx, ops, plan)``: the feed-forward block of layer ``layer_idx``, a module
  ``forward(hidden [T, H]) -> [T, H]`` whose parameters sit under ``model.layers.{i}.mlp``. The
  default is the dense SwiGLU ``DenseMLP``; an MoE family returns its sparse block for the layers
  that have experts (and ``DenseMLP(config, ops, intermediate_size=..., plan=plan)`` for dense ones, e.g.
  GLM-4 MoE's ``first_k_dense_replace``). Its weight mapping extends ``packed_modules_mapping`` /
  ``weight_name_rules`` / ``ignored_weights`` on the class (see ``turnout.models.weight_map``).
- ``make_attention(config, layer_idx, ops, rotary, plan)``: likewise for the attention block.

``plan`` is the fusion plan (turnout/layers/fusion.py): which fused decode kernels the layers use, fixed
when the model is built; pass it on to every block and projection.

``tp`` (turnout/distributed: this rank's ``TPGroup``, default ``SINGLE``) makes the model this rank's shard:
attention heads and kv heads split per rank (kv heads replicated when tp > num_kv_heads), the MLP's
intermediate dim split, the vocabulary split (embedding and head), and each checkpoint tensor loads its
slice through the same declarative map. A hook reads it as ``self.tp``. Every fusion of the plan applies to a
shard unchanged: a one-row projection is one on its rows, a pre-norm is computed by the column-parallel
projection that reads it (its input is whole on every rank, so each rank computes the same norm), and
rope / the cache write / attention work per head. A family whose blocks cannot be split yet sets
``supports_tensor_parallel = False`` and refuses tp > 1.

Parameter names follow HF's (``model.layers.{i}.self_attn.qkv_proj`` packs ``q_proj``/``k_proj``/
``v_proj``; ``mlp.gate_up_proj`` packs ``gate_proj``/``up_proj``), so checkpoints load through the map.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.activation import SiluAndMul
from turnout.layers.attention import Attention, AttentionMetadata
from turnout.layers.embedding import LMHead, VocabEmbedding
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, kv_heads_per_rank
from turnout.layers.norm import PendingNorm, RMSNorm
from turnout.layers.rotary import RotaryEmbedding, get_rope
from turnout.models.weight_map import load_weights


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DenseMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into ``gate_up_proj``."""

    def __init__(self, config, ops, intermediate_size: int | None = None, bias: bool | None = None,
                 plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        bias = getattr(config, "mlp_bias", False) if bias is None else bias
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias, tp=tp, ops=ops,
                                                       plan=plan)  # [T, 2 I / tp]: this rank's gate, then its up
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, tp=tp, ops=ops, plan=plan)
        self.act_fn = SiluAndMul(ops)

    takes_pending_norm = True  # gate_up_proj may compute the layer's pre-norm (PendingNorm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, H]


class DecoderAttention(nn.Module):
    """qkv projection, optional per-head q/k norm, rope, paged attention, output projection."""

    def __init__(self, config, ops, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads,
                                          bias=qkv_bias, tp=tp, ops=ops, plan=plan)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=o_bias, tp=tp, ops=ops,
                                        plan=plan)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.qk_norm = qk_norm
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, ops)
        # plan.rope_attention: at decode, q/k norm, RoPE, the cache write and attention in one kernel (the
        # rotary_paged_attention op); None: the separate ops. (benchmarks/decode_ablation.py swaps it out.)
        self.rope_attention = (lambda *args, **kw: ops.rotary_paged_attention(*args, **kw)) if plan.rope_attention \
            else None

    takes_pending_norm = True  # qkv_proj may compute the layer's pre-norm (PendingNorm)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata):
        t = hidden.shape[0]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D], strided view of the fused qkv
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.rope_attention is not None and meta.max_query_len == 1:  # decode: all of it in one kernel
            out = self.rope_attention(
                positions, q, k, v, self.q_norm.weight if self.qk_norm else None,
                self.k_norm.weight if self.qk_norm else None, self.q_norm.eps if self.qk_norm else 0.0,
                self.rotary_emb.cos_sin_cache, self.rotary_emb.is_neox, kv_cache[0], kv_cache[1], meta.slot_mapping,
                meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, meta.max_seq_len,
                self.attn.scale, **self.attn.attention_kwargs)
        elif self.qk_norm:  # per-head norms, then RoPE, in place in the fused qkv; k and v into the cache
            self.rotary_emb.with_qk_norm(positions, q, k, self.q_norm, self.k_norm, v, kv_cache, meta.slot_mapping,
                                         **self.attn.cache_kwargs)
            out = self.attn(q, k, v, kv_cache, meta, cache_written=True)  # [T, Hq, D]
        else:
            self.rotary_emb(positions, q, k)
            out = self.attn(q, k, v, kv_cache, meta)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, config, ops, plan: FusionPlan = NO_FUSIONS):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        # plan.prenorm_linear: at one row each pre-norm is computed inside the first projection that reads it
        # (add_rms_norm_linear, where the projection's shape takes it), not by a kernel of its own.
        self.fuse_prenorms = plan.prenorm_linear

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if self.fuse_prenorms and hidden.shape[0] == 1:
            return self._forward_fused_norms(positions, hidden, residual, kv_cache, meta)
        if residual is None:  # first layer: the embedding output is the residual stream
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def _forward_fused_norms(self, positions, hidden, residual, kv_cache, meta):
        x = PendingNorm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, _block_input(x, self.self_attn), kv_cache, meta)
        x = PendingNorm(self.post_attention_layernorm, hidden, x.residual)
        hidden = self.mlp(_block_input(x, self.mlp))
        return hidden, x.residual


def _block_input(x: PendingNorm, block: nn.Module):
    """The pending norm for a block that takes one (its first projection computes it), else the tensor now."""
    return x if getattr(block, "takes_pending_norm", False) else x.tensor()


class DecoderModel(nn.Module):
    """Embedding, the layers, the final norm. Built by ``DecoderForCausalLM``, which supplies the hooks."""

    def __init__(self, config, ops, family: "DecoderForCausalLM", plan: FusionPlan = NO_FUSIONS):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp=family.tp, ops=ops)
        rotary = get_rope(config, head_dim_of(config), config.max_position_embeddings, ops,
                          is_neox=family.rope_is_neox)  # one cos/sin cache shared by every layer
        self.layers = nn.ModuleList(
            DecoderLayer(family.make_attention(config, i, ops, rotary, plan), family.make_mlp(config, i, ops, plan),
                         config, ops, plan)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, input_ids, positions, kv_caches, meta):
        hidden, residual = self.embed_tokens(input_ids), None  # [T, H]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """``cls(config, ops, plan)`` under the target device and default dtype; see the module docstring."""

    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False
    rope_is_neox: bool = True
    packed_modules_mapping = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }
    weight_name_rules: list = []
    ignored_weights: tuple[str, ...] = ()
    supports_tensor_parallel: bool = True

    def __init__(self, config, ops, plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE):
        super().__init__()
        if tp.size > 1 and not self.supports_tensor_parallel:
            raise ValueError(f"tensor_parallel_size {tp.size}: {type(self).__name__} does not support tensor "
                             "parallelism yet (its expert blocks are not split); use tensor_parallel_size 1")
        self.config = config
        self.ops = ops
        self.plan = plan
        self.tp = tp  # read by the hooks below while the layers are built
        total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.kv_heads_per_rank = kv_heads_per_rank(total_kv, tp.size)  # the KV cache of this rank: [.., Hk_local, D]
        self.model = DecoderModel(config, ops, self, plan)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size,
                              tie_to=self.model.embed_tokens if tied else None, tp=tp, ops=ops, plan=plan)
        if tied:  # some tied checkpoints still store the head; it is the embedding, so drop it
            self.ignored_weights = (*type(self).ignored_weights, r"^lm_head\.weight$")

    def make_attention(self, config, layer_idx: int, ops, rotary: RotaryEmbedding,
                       plan: FusionPlan = NO_FUSIONS) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderAttention(config, ops, rotary,
                                qkv_bias=bias if self.qkv_bias is None else self.qkv_bias,
                                o_bias=bias if self.o_bias is None else self.o_bias,
                                qk_norm=self.qk_norm, plan=plan, tp=self.tp)

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS) -> nn.Module:
        return DenseMLP(config, ops, plan=plan, tp=self.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] int64 -> hidden [T, H] (final-normed)."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 (into ``out`` when given)."""
        return self.lm_head(hidden, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, weights)
