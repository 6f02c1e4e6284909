"""Mixtral: the Mistral decoder with every MLP a sparse block of ``num_local_experts`` SwiGLU experts.

Routing: softmax over the top-k logits (the same weights as softmax, top-k, renormalise). Checkpoint
names: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2``
(down); ours live under ``mlp`` like every other family.
"""

from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.moe.experts import expert_weight_rules
from turnout.layers.moe.layer import SparseMoeBlock
from turnout.layers.moe.router import RoutingConfig
from turnout.models.decoder import DecoderForCausalLM


class MixtralForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = False  # the expert blocks (turnout/layers/moe) are not split per rank yet
    weight_name_rules = [
        *expert_weight_rules(module=r"block_sparse_moe\.experts", names={"w1": "gate", "w3": "up", "w2": "down"}),
        (r"(^|\.)block_sparse_moe\.gate\.weight$", r"\g<1>mlp.gate.weight", None),
        # transformers 5 may also save the stacked in-memory layout
        (r"(^|\.)block_sparse_moe\.experts\.(gate_up_proj|down_proj)$", r"\g<1>mlp.experts.\g<2>", None),
    ]

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        # Mixtral experts are `intermediate_size` wide; there are no dense layers.
        return SparseMoeBlock(config.hidden_size, config.intermediate_size, RoutingConfig.from_hf_config(config), ops,
                              plan=plan)
