"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (biased q/k/v), softmax top-k experts, and a
shared expert scaled by a per-token sigmoid gate (``shared_expert_gate`` [1, H]). Tensor / expert parallel:
turnout/models/moe_decoder.py."""

from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.moe.experts import expert_weight_rules
from turnout.layers.moe.layer import is_moe_layer
from turnout.models.moe_decoder import MoeDecoderForCausalLM


class Qwen2MoeForCausalLM(MoeDecoderForCausalLM):
    qkv_bias = True
    o_bias = False
    weight_name_rules = expert_weight_rules()

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        if not getattr(config, "num_experts", 0) or not is_moe_layer(config, layer_idx):
            return self.dense_mlp(config, ops, plan, config.intermediate_size)
        return self.sparse_block(config, ops, plan, config.moe_intermediate_size,
                                 shared_intermediate_size=config.shared_expert_intermediate_size,
                                 shared_gated=True, shared_name="shared_expert")
