"""Qwen3-MoE: the Qwen3 decoder (per-head q/k norm) with softmax top-k routed experts.

Routing: softmax over all experts, top-k, renormalised when ``norm_topk_prob``. Dense layers:
``mlp_only_layers`` and layers off ``decoder_sparse_step``. Tensor / expert parallel: turnout/models/moe_decoder.py.
"""

from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.moe.experts import expert_weight_rules
from turnout.layers.moe.layer import is_moe_layer
from turnout.models.moe_decoder import MoeDecoderForCausalLM


class Qwen3MoeForCausalLM(MoeDecoderForCausalLM):
    qk_norm = True
    weight_name_rules = expert_weight_rules()

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        if not getattr(config, "num_experts", 0) or not is_moe_layer(config, layer_idx):
            return self.dense_mlp(config, ops, plan, config.intermediate_size)
        return self.sparse_block(config, ops, plan, config.moe_intermediate_size)
