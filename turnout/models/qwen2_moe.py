"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (biased q/k/v), softmax top-k experts, and a
shared expert scaled by a per-token sigmoid gate (``shared_expert_gate`` [1, H])."""

from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.moe.experts import expert_weight_rules
from turnout.layers.moe.layer import SparseMoeBlock, is_moe_layer
from turnout.layers.moe.router import RoutingConfig
from turnout.models.decoder import DecoderForCausalLM, DenseMLP


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = False  # the expert blocks (turnout/layers/moe) are not split per rank yet
    qkv_bias = True
    o_bias = False
    weight_name_rules = expert_weight_rules()

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        if not getattr(config, "num_experts", 0) or not is_moe_layer(config, layer_idx):
            return DenseMLP(config, ops, intermediate_size=config.intermediate_size, plan=plan)
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, RoutingConfig.from_hf_config(config),
                              ops, shared_intermediate_size=config.shared_expert_intermediate_size,
                              shared_gated=True, shared_name="shared_expert", plan=plan)
