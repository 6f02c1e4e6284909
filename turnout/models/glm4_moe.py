"""GLM-4.5 / GLM-4.6 (Glm4Moe): sigmoid-scored experts chosen with a correction bias among the best groups
(``noaux_tc``), renormalised, times ``routed_scaling_factor``; a shared expert; the first
``first_k_dense_replace`` layers dense. Attention: q/k/v biased per ``attention_bias``, o_proj unbiased,
optional per-head q/k norm (``use_qk_norm``), rope on the first ``partial_rotary_factor`` of each head
(rotate-half). The multi-token-prediction layers some checkpoints carry past ``num_hidden_layers`` are
not part of the causal LM and are skipped. Tensor / expert parallel: turnout/models/moe_decoder.py.
"""

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.moe.experts import expert_weight_rules
from turnout.layers.moe.layer import is_moe_layer
from turnout.models.decoder import DecoderAttention
from turnout.models.moe_decoder import MoeDecoderForCausalLM


class Glm4MoeForCausalLM(MoeDecoderForCausalLM):
    o_bias = False
    weight_name_rules = expert_weight_rules()

    def __init__(self, config, ops, plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE,
                 expert_parallel: bool = False):
        super().__init__(config, ops, plan, tp, expert_parallel)
        first = config.num_hidden_layers
        mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        if mtp:
            layers = "|".join(str(i) for i in range(first, first + mtp))
            self.ignored_weights = (*self.ignored_weights, rf"^model\.layers\.({layers})\.")

    def make_attention(self, config, layer_idx: int, ops, rotary, plan: FusionPlan = NO_FUSIONS):
        return DecoderAttention(config, ops, rotary, qkv_bias=bool(getattr(config, "attention_bias", False)),
                                o_bias=False, qk_norm=bool(getattr(config, "use_qk_norm", False)), plan=plan,
                                tp=self.tp, spec=self.attention_spec(config, layer_idx))

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        if not is_moe_layer(config, layer_idx):
            return self.dense_mlp(config, ops, plan, config.intermediate_size)
        return self.sparse_block(config, ops, plan, config.moe_intermediate_size,
                                 shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                                 router_logits_fp32=True)
