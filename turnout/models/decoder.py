"""The decoder shared by every family (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, OLMo 2, the MoE families),
composed from declared parts when it is built.

A model family is a subclass that sets a few class attributes:

- ``qkv_bias`` / ``o_bias``: ``None`` reads ``config.attention_bias``; a bool forces it (Qwen2: q/k/v
  biased, o_proj not).
- ``qk_norm``: RMSNorm over each head of q and k before rope (Qwen3, GLM-4 MoE with ``use_qk_norm``).
- ``rope_is_neox``: rotate halves (True) or interleaved pairs.
- ``norm_placement``: ``"pre"`` (default), ``"sandwich"`` (Gemma 2/3) or ``"post"``: turnout/models/decoder_layer.py.
- ``norm_unit_offset``: every RMSNorm scales by (1 + w) (Gemma). ``scale_embeddings``: embeddings times
  sqrt(hidden_size) (Gemma). ``window_every_layer``: ``config.sliding_window`` on every layer (Mistral).
  ``attention_sinks``: a learned sink logit per head (GPT-OSS).
- ``make_mlp(config, layer_idx, ops, plan)``: the feed-forward block of layer ``layer_idx``, a module
  ``forward(hidden [T, H]) -> [T, H]`` whose parameters sit under ``model.layers.{i}.mlp``. The
  default is the dense SwiGLU ``DenseMLP``; an MoE family returns its sparse block for the layers
  that have experts (and ``DenseMLP(config, ops, intermediate_size=..., plan=plan)`` for dense ones, e.g.
  GLM-4 MoE's ``first_k_dense_replace``). Its weight mapping extends ``packed_modules_mapping`` /
  ``weight_name_rules`` / ``ignored_weights`` on the class (see ``turnout.models.weight_map``).
- ``make_attention(config, layer_idx, ops, rotary, plan)``: likewise for the attention block (``rotary``: layer
  ``layer_idx``'s rope); ``attention_spec(config, layer_idx)``: its window, soft-cap, scale and sinks.

What the config says is read for every family alike (turnout/models/layer_spec.py): the activation
(``hidden_act`` / ``hidden_activation``), per-layer attention type (``layer_types``, ``sliding_window``), the
attention scale (``query_pre_attn_scalar``), attention and final logit soft-caps, per-layer-type rope, biases,
a tied head. Each choice is made once, here, when the layers are built: a Llama-shaped model runs the same
modules and kernels it always did.

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
from turnout.layers.activation import gated_activation
from turnout.layers.attention import Attention, AttentionMetadata
from turnout.layers.embedding import LMHead, VocabEmbedding
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, kv_heads_per_rank
from turnout.layers.norm import RMSNorm
from turnout.layers.rotary import RotaryEmbedding, get_rope, rope_by_layer_type
from turnout.models.decoder_layer import LAYER_CLASSES, DecoderLayer
from turnout.models.layer_spec import (
    NORM_PLACEMENTS,
    AttentionSpec,
    activation_name,
    attention_spec,
    final_logit_softcap,
    layer_types,
)
from turnout.models.weight_map import load_weights

PLAIN_ATTENTION = AttentionSpec()  # full attention, the config's scale: what most layers have

__all__ = ["AttentionSpec", "DecoderAttention", "DecoderForCausalLM", "DecoderLayer", "DecoderModel", "DenseMLP",
           "head_dim_of"]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DenseMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up fused into ``gate_up_proj``; ``act`` the config's
    (``hidden_act`` / ``hidden_activation``: silu, gelu-tanh), or the module ``activation`` given."""

    def __init__(self, config, ops, intermediate_size: int | None = None, bias: bool | None = None,
                 plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE, activation: nn.Module | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        bias = getattr(config, "mlp_bias", False) if bias is None else bias
        if activation is None:
            name, field = activation_name(config)
            activation = gated_activation(name, ops, field)
        self.act_fn = activation
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias, tp=tp, ops=ops,
                                                       plan=plan)  # [T, 2 I / tp]: this rank's gate, then its up
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, tp=tp, ops=ops, plan=plan)

    takes_pending_norm = True  # gate_up_proj may compute the layer's pre-norm (PendingNorm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, H]


class DecoderAttention(nn.Module):
    """qkv projection, optional per-head q/k norm, rope, paged attention, output projection.

    ``spec``: the layer's attention as its config declares it (window, soft-cap, scale, sinks:
    turnout/models/layer_spec.py); ``norm_unit_offset``: the q/k norms scale by (1 + w) (Gemma 3)."""

    def __init__(self, config, ops, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE, spec: AttentionSpec = PLAIN_ATTENTION,
                 norm_unit_offset: bool = False):
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
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, unit_offset=norm_unit_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, unit_offset=norm_unit_offset)
        self.qk_norm = qk_norm
        self.rotary_emb = rotary
        scale = self.head_dim ** -0.5 if spec.scale is None else spec.scale
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, ops, tp=tp,
                              **spec.attention_kwargs())  # tp: which heads' sinks this rank holds
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
        return self.attend(positions, q, k, v, kv_cache, meta)

    def attend(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache,
               meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k / v [T, Hk, D] (views of the projection) -> the output projection [T, H]: q/k norm,
        rope, the cache write, attention. A block that projects otherwise (OLMo 2's whole-projection norms)
        calls it after its own projection."""
        t = q.shape[0]
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


class DecoderModel(nn.Module):
    """Embedding, the layers, the final norm. Built by ``DecoderForCausalLM``, which supplies the hooks."""

    def __init__(self, config, ops, family: "DecoderForCausalLM", plan: FusionPlan = NO_FUSIONS):
        super().__init__()
        scale = config.hidden_size ** 0.5 if family.scale_embeddings else None
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp=family.tp, ops=ops, scale=scale)
        ropes = _ropes(config, family, ops)
        layer_cls = LAYER_CLASSES[family.norm_placement]
        self.layers = nn.ModuleList(
            layer_cls(family.make_attention(config, i, ops, ropes[i], plan), family.make_mlp(config, i, ops, plan),
                      config, ops, plan, norm=family.make_norm)
            for i in range(config.num_hidden_layers))
        self.norm = family.make_norm()

    def forward(self, input_ids, positions, kv_caches, meta):
        hidden, residual = self.embed_tokens(input_ids), None  # [T, H]
        metas = meta.layer_metas()  # None: one block table, every layer reads meta
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta if metas is None else metas[i])
        hidden, _ = self.norm(hidden, residual)
        return hidden


def _ropes(config, family: "DecoderForCausalLM", ops) -> list[RotaryEmbedding]:
    """Each layer's rotary embedding: one cos/sin cache shared by every layer, or one per layer type where the
    config sets rope per type (Gemma 3: the sliding layers' own base frequency)."""
    types = layer_types(config)
    per_type = rope_by_layer_type(config) or getattr(config, "rope_local_base_freq", None) is not None
    made: dict[str | None, RotaryEmbedding] = {}
    for t in dict.fromkeys(types if per_type else [None]):
        made[t] = get_rope(config, head_dim_of(config), config.max_position_embeddings, ops,
                           is_neox=family.rope_is_neox, layer_type=t)
    return [made[t if per_type else None] for t in types]


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
    no_tensor_parallel_reason: str = "its expert blocks are not split"  # said when tp > 1 is refused
    # The layer's composition (turnout/models/layer_spec.py reads the rest from the config):
    norm_placement: str = "pre"  # "pre" | "sandwich" | "post" (turnout/models/decoder_layer.py)
    norm_unit_offset: bool = False  # every RMSNorm scales by (1 + w) (Gemma)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), in the model dtype (Gemma)
    window_every_layer: bool = False  # config.sliding_window on every layer, no layer_types (Mistral, Mixtral)
    attention_sinks: bool = False  # a learned sink logit per head, checkpoint self_attn.sinks (GPT-OSS)

    def __init__(self, config, ops, plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE):
        super().__init__()
        if tp.size > 1 and not self.supports_tensor_parallel:
            raise ValueError(f"tensor_parallel_size {tp.size}: {type(self).__name__} does not support tensor "
                             f"parallelism yet ({self.no_tensor_parallel_reason}); use tensor_parallel_size 1")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"{type(self).__name__}.norm_placement {self.norm_placement!r}: expected one of "
                             f"{', '.join(NORM_PLACEMENTS)}")
        self.config = config
        self.ops = ops
        self.plan = plan
        self.tp = tp  # read by the hooks below while the layers are built
        total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.kv_heads_per_rank = kv_heads_per_rank(total_kv, tp.size)  # the KV cache of this rank: [.., Hk_local, D]
        self.model = DecoderModel(config, ops, self, plan)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size,
                              tie_to=self.model.embed_tokens if tied else None, tp=tp, ops=ops, plan=plan,
                              softcap=final_logit_softcap(config))
        if tied:  # some tied checkpoints still store the head; it is the embedding, so drop it
            self.ignored_weights = (*type(self).ignored_weights, r"^lm_head\.weight$")
        if self.attention_sinks:  # HF keeps them on the attention block; ours on its Attention layer
            self.weight_name_rules = [(r"(^|\.)self_attn\.sinks$", r"\g<1>self_attn.attn.sinks", None),
                                      *type(self).weight_name_rules]

    def make_norm(self, size: int | None = None) -> RMSNorm:
        """A norm of this model's kind over ``size`` (default hidden_size): the decoder's, the layers' and q/k's."""
        return RMSNorm(size or self.config.hidden_size, self.config.rms_norm_eps, self.ops,
                       unit_offset=self.norm_unit_offset)

    def attention_spec(self, config, layer_idx: int) -> AttentionSpec:
        """Layer ``layer_idx``'s attention variant (window, soft-cap, scale, sinks) from the config."""
        return attention_spec(config, layer_idx, window_every_layer=self.window_every_layer,
                              sinks=self.attention_sinks)

    def make_attention(self, config, layer_idx: int, ops, rotary: RotaryEmbedding,
                       plan: FusionPlan = NO_FUSIONS) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderAttention(config, ops, rotary,
                                qkv_bias=bias if self.qkv_bias is None else self.qkv_bias,
                                o_bias=bias if self.o_bias is None else self.o_bias,
                                qk_norm=self.qk_norm, plan=plan, tp=self.tp,
                                spec=self.attention_spec(config, layer_idx), norm_unit_offset=self.norm_unit_offset)

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
