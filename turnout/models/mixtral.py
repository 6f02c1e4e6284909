"""Mixtral: the Mistral decoder (``sliding_window`` on every layer) with every MLP a sparse block of ``num_local_experts`` SwiGLU experts.

Routing: softmax over the top-k logits (the same weights as softmax, top-k, renormalise). Checkpoint
names: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2``
(down); ours live under ``mlp`` like every other family. Tensor / expert parallel: turnout/models/moe_decoder.py.
"""

from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.moe.experts import expert_weight_rules
from turnout.models.moe_decoder import MoeDecoderForCausalLM


class MixtralForCausalLM(MoeDecoderForCausalLM):
    window_every_layer = True  # Mistral's attention: config.sliding_window (null in the released checkpoints)
    weight_name_rules = [
        *expert_weight_rules(module=r"block_sparse_moe\.experts", names={"w1": "gate", "w3": "up", "w2": "down"}),
        (r"(^|\.)block_sparse_moe\.gate\.weight$", r"\g<1>mlp.gate.weight", None),
        # transformers 5 may also save the stacked in-memory layout
        (r"(^|\.)block_sparse_moe\.experts\.(gate_up_proj|down_proj)$", r"\g<1>mlp.experts.\g<2>", None),
    ]

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        # Mixtral experts are `intermediate_size` wide; there are no dense layers.
        return self.sparse_block(config, ops, plan, config.intermediate_size)
