"""Qwen3-MoE: the Qwen3 decoder (per-head q/k norm) with softmax top-k routed experts.

Routing: softmax over all experts, top-k, renormalised when ``norm_topk_prob``. Dense layers:
``mlp_only_layers`` and layers off ``decoder_sparse_step``.
"""

from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.moe.experts import expert_weight_rules
from turnout.layers.moe.layer import SparseMoeBlock, is_moe_layer
from turnout.layers.moe.router import RoutingConfig
from turnout.models.decoder import DecoderForCausalLM, DenseMLP


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = False  # the expert blocks (turnout/layers/moe) are not split per rank yet
    qk_norm = True
    weight_name_rules = expert_weight_rules()

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        if not getattr(config, "num_experts", 0) or not is_moe_layer(config, layer_idx):
            return DenseMLP(config, ops, intermediate_size=config.intermediate_size, plan=plan)
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, RoutingConfig.from_hf_config(config),
                              ops, plan=plan)
