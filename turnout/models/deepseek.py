"""The latent-attention families: DeepSeek-V2 (V2-Lite: no query compression), DeepSeek-V3 / R1 (and Kimi-K2's
checkpoints, which name themselves DeepseekV3ForCausalLM), GLM-4 MoE Lite.

Attention is multi-head latent attention (turnout/layers/mla.py: a latent cache, absorbed attention). The MoE
parts are the shared ones: routed experts with shared experts (``n_shared_experts`` x ``moe_intermediate_size``);
V2's softmax routing (``greedy`` / ``group_limited_greedy``), V3's and GLM's ``noaux_tc`` (sigmoid, correction
bias, ``n_group`` / ``topk_group``, renormalised), times ``routed_scaling_factor``, all through
``select_experts`` (turnout/layers/moe/router.py). Dense layers: the first ``first_k_dense_replace`` and those off
``moe_layer_freq`` (DeepSeek), or ``mlp_layer_types`` (GLM-4 MoE Lite).

The checkpoint's multi-token-prediction layers (``num_nextn_predict_layers`` layers past ``num_hidden_layers``)
are loaded into ``self.mtp`` (turnout/models/mtp.py), which the "mtp" speculative method drafts with
(turnout/engine/hidden_drafts.py); they are not part of the causal LM's forward, and the KV cache is the main
layers' (``kv_specs``).

Refused by name: batch-invariant mode (no MLA implementation is declared invariant: the Triton kernel's split
count follows the batch), a sparse-attention indexer (DeepSeek-V3.2's ``index_topk`` ...), a scoring function the family
does not use, an unknown ``mlp_layer_types`` entry.
"""

from __future__ import annotations

import dataclasses

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.mla import MLAAttention, dequantize_latent_up
from turnout.layers.mla_prefill import plan_latent_prefill
from turnout.layers.moe.experts import expert_weight_rules
from turnout.layers.moe.layer import is_moe_layer
from turnout.models.moe_decoder import MoeDecoderForCausalLM
from turnout.models.mtp import MultiTokenPredictor, checkpoint_names, mtp_layer_name
from turnout.models.weight_map import load_weights

# fields of variants whose attention this family does not compute: refused, never run as plain MLA
UNSUPPORTED_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")


def _check_variant(config, scoring: str) -> None:
    for name in UNSUPPORTED_FIELDS:
        if getattr(config, name, None) is not None:
            raise ValueError(f"{name}={getattr(config, name)!r}: the sparse-attention indexer (DeepSeek-V3.2) is not "
                             f"supported; turnout runs dense multi-head latent attention only")
    func = getattr(config, "scoring_func", None)
    if func is not None and func != scoring:
        raise ValueError(f"scoring_func {func!r}: {config.model_type} routes with {scoring!r}")
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not isinstance(getattr(config, name, None), int) or getattr(config, name) < 1:
            raise ValueError(f"{name}={getattr(config, name, None)!r}: multi-head latent attention needs a positive "
                             f"integer")


class DeepseekV2ForCausalLM(MoeDecoderForCausalLM):
    o_bias = False
    packed_modules_mapping = {"gate_up_proj": [("gate_proj", 0), ("up_proj", 1)]}  # q_proj is MLA's own
    weight_name_rules = expert_weight_rules()
    scoring = "softmax"

    def __init__(self, config, ops, plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE,
                 expert_parallel: bool = False):
        _check_variant(config, self.scoring)
        policy = getattr(ops, "policy", None)
        if policy is not None and policy.batch_invariant:  # no MLA implementation is declared invariant yet
            raise ValueError(f"batch_invariant: {type(self).__name__}'s latent attention has no batch-invariant "
                             "implementation yet; use batch_invariant=False")
        super().__init__(config, ops, plan, tp, expert_parallel)
        self.mla_prefill = plan.mla_prefill
        n_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        self.mtp = MultiTokenPredictor(config, ops, self, plan, n_mtp) if n_mtp else None

    @property
    def rope_is_neox(self) -> bool:
        # V2 rotates complex pairs (interleaved) always; V3 / GLM where rope_interleave says so (their default)
        return not bool(getattr(self.config, "rope_interleave", True))

    def make_attention(self, config, layer_idx: int, ops, rotary, plan: FusionPlan = NO_FUSIONS):
        return MLAAttention(config, ops, rotary, plan=plan, tp=self.tp)

    def is_sparse(self, config, layer_idx: int) -> bool:
        return is_moe_layer(config, layer_idx)

    def forward(self, input_ids, positions, kv_caches, meta):
        """The decoder's forward with this step's prefill plan (absorbed or decompressed per sequence,
        turnout/layers/mla_prefill.py) made once, for every layer."""
        plan = plan_latent_prefill(meta, self.mla_prefill, self.model.layers[0].self_attn.latent_dims)
        if plan is not None:
            meta = dataclasses.replace(meta, latent_prefill=plan)
        return super().forward(input_ids, positions, kv_caches, meta)

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        if not self.is_sparse(config, layer_idx):
            return self.dense_mlp(config, ops, plan, config.intermediate_size)
        shared = int(getattr(config, "n_shared_experts", 0) or 0) * config.moe_intermediate_size
        return self.sparse_block(config, ops, plan, config.moe_intermediate_size, shared_intermediate_size=shared,
                                 router_logits_fp32=True)

    def kv_specs(self, cache_dtype: str):
        """The main layers' latent caches (the MTP layers' attention is not in the causal LM's step)."""
        return [layer.self_attn.kv_spec(cache_dtype) for layer in self.model.layers]

    def load_weights(self, weights):
        n = self.config.num_hidden_layers
        count = self.mtp.num_layers if self.mtp is not None else 0
        try:
            renamed = ((mtp_layer_name(name, n, count), t) for name, t in weights)
            return load_weights(self, dequantize_latent_up(renamed))
        except ValueError as e:  # name an MTP tensor as the checkpoint does (model.layers.{n + i}.)
            raise ValueError(checkpoint_names(str(e), n)) from None


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    scoring = "sigmoid"


class Glm4MoeLiteForCausalLM(DeepseekV2ForCausalLM):
    scoring = "sigmoid"

    def is_sparse(self, config, layer_idx: int) -> bool:
        types = getattr(config, "mlp_layer_types", None)
        if types is None:
            return is_moe_layer(config, layer_idx)
        if layer_idx >= len(types):  # a multi-token-prediction layer past the decoder's: sparse, as in GLM's
            return True
        kind = types[layer_idx]
        if kind not in ("dense", "sparse"):
            raise ValueError(f"mlp_layer_types[{layer_idx}] = {kind!r}: expected 'dense' or 'sparse'")
        return kind == "sparse"

