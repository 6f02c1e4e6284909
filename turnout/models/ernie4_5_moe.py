"""ERNIE-4.5 MoE (``Ernie4_5_MoeForCausalLM``, e.g. ERNIE-4.5-21B-A3B, 300B-A47B): the ERNIE-4.5 dense attention
(interleaved rope, ``use_bias``) with routed experts on the layers ``moe_layer_start_index`` <= i <=
``moe_layer_end_index`` (-1: the last) where (i + 1) % ``moe_layer_interval`` == 0, dense MLPs
(``intermediate_size``) elsewhere.

Routing (transformers' ``Ernie4_5_MoeTopKRouter``): a float32 gate, softmax over every expert, the top
``moe_k`` chosen by softmax + ``e_score_correction_bias`` (the aux-free balancing bias, checkpoint
``mlp.moe_statics.e_score_correction_bias`` [1, E]; it chooses, never weights), the chosen softmax
probabilities renormalised. ``moe_num_shared_experts`` shared experts are one dense expert
``moe_intermediate_size * moe_num_shared_experts`` wide, added unweighted. The multi-token-prediction weights
some checkpoints carry (``mtp*``) are not part of the causal LM and are skipped. Tensor / expert parallel:
turnout/models/moe_decoder.py."""

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.moe.experts import expert_weight_rules
from turnout.models.decoder import DecoderAttention, DenseMLP
from turnout.models.ernie4_5 import use_bias
from turnout.models.moe_decoder import MoeDecoderForCausalLM


def _layer_index(config, name: str, default: int) -> int:
    value = getattr(config, name, None)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):  # the VL models' per-modality lists
        raise ValueError(f"{name} must be an integer for Ernie4_5_MoeForCausalLM, got {value!r}")
    return value


def is_ernie_moe_layer(config, layer_idx: int) -> bool:
    start = _layer_index(config, "moe_layer_start_index", 0)
    end = _layer_index(config, "moe_layer_end_index", -1)
    end = config.num_hidden_layers - 1 if end == -1 else end
    interval = _layer_index(config, "moe_layer_interval", 1)
    if interval < 1:
        raise ValueError(f"moe_layer_interval must be >= 1, got {interval}")
    return start <= layer_idx <= end and (layer_idx + 1) % interval == 0


class Ernie4_5_MoeForCausalLM(MoeDecoderForCausalLM):
    rope_is_neox = False
    weight_name_rules = [
        *expert_weight_rules(),
        # the bias lives on the router (it chooses experts); transformers renames it under mlp.gate too
        (r"(^|\.)mlp\.(gate\.)?moe_statics\.e_score_correction_bias$", r"\g<1>mlp.gate.e_score_correction_bias",
         None),
    ]
    ignored_weights = (r"(^|\.)mtp",)

    def __init__(self, config, ops, plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE,
                 expert_parallel: bool = False):
        if use_bias(config):  # no released ERNIE-4.5 MoE checkpoint has biased projections
            raise ValueError("use_bias=True is not supported for Ernie4_5_MoeForCausalLM: turnout's shared "
                             "experts and LM head take no bias")
        super().__init__(config, ops, plan, tp, expert_parallel)

    def make_attention(self, config, layer_idx: int, ops, rotary, plan: FusionPlan = NO_FUSIONS):
        return DecoderAttention(config, ops, rotary, qkv_bias=False, o_bias=False, qk_norm=False, plan=plan,
                                tp=self.tp, spec=self.attention_spec(config, layer_idx))

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        if not is_ernie_moe_layer(config, layer_idx):
            return DenseMLP(config, ops, intermediate_size=config.intermediate_size, bias=False, plan=plan,
                            tp=self.tp)
        shared = int(getattr(config, "moe_num_shared_experts", 0) or 0)
        return self.sparse_block(config, ops, plan, config.moe_intermediate_size,
                                 shared_intermediate_size=config.moe_intermediate_size * shared,
                                 router_logits_fp32=True)
