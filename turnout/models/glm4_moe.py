"""GLM-4.5 / GLM-4.6 (Glm4Moe): sigmoid-scored experts chosen with a correction bias among the best groups
(``noaux_tc``), renormalised, times ``routed_scaling_factor``; a shared expert; the first
``first_k_dense_replace`` layers dense. Attention: q/k/v biased per ``attention_bias``, o_proj unbiased,
optional per-head q/k norm (``use_qk_norm``), rope on the first ``partial_rotary_factor`` of each head
(rotate-half). The multi-token-prediction layers some checkpoints carry past ``num_hidden_layers`` are
not part of the causal LM and are skipped.
"""

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.moe.experts import expert_weight_rules
from turnout.layers.moe.layer import SparseMoeBlock, is_moe_layer
from turnout.layers.moe.router import RoutingConfig
from turnout.models.decoder import DecoderAttention, DecoderForCausalLM, DenseMLP


class Glm4MoeForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = False  # the expert blocks (turnout/layers/moe) are not split per rank yet
    o_bias = False
    weight_name_rules = expert_weight_rules()

    def __init__(self, config, ops, plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE):
        super().__init__(config, ops, plan, tp)
        first = config.num_hidden_layers
        mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        if mtp:
            layers = "|".join(str(i) for i in range(first, first + mtp))
            self.ignored_weights = (*self.ignored_weights, rf"^model\.layers\.({layers})\.")

    def make_attention(self, config, layer_idx: int, ops, rotary, plan: FusionPlan = NO_FUSIONS):
        return DecoderAttention(config, ops, rotary, qkv_bias=bool(getattr(config, "attention_bias", False)),
                                o_bias=False, qk_norm=bool(getattr(config, "use_qk_norm", False)), plan=plan)

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        if not is_moe_layer(config, layer_idx):
            return DenseMLP(config, ops, intermediate_size=config.intermediate_size, plan=plan)
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, RoutingConfig.from_hf_config(config),
                              ops, shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                              router_logits_fp32=True, plan=plan)
