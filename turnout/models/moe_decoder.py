"""The shared decoder with sparse MoE blocks: what the four MoE families (qwen2_moe, qwen3_moe, mixtral,
glm4_moe) have in common beyond their routing rules and checkpoint names.

``cls(config, ops, plan, tp, expert_parallel=False)``. Under tensor parallelism (``tp``) attention and the dense
layers split as in every family, the router is replicated (so ``select_experts`` runs on every rank on the same
input and gives the same ids), the shared expert splits like a dense MLP, and the routed experts split by the
intermediate dim, or by expert id with ``expert_parallel`` (``EngineConfig.enable_expert_parallel``; rank r
holds experts [r E/W, (r+1) E/W)). One ``all_reduce`` per MoE layer sums the ranks' routed and shared parts
(turnout/layers/moe/layer.py).
"""

from __future__ import annotations

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.moe.layer import SparseMoeBlock
from turnout.layers.moe.router import RoutingConfig
from turnout.models.decoder import DecoderForCausalLM, DenseMLP


class MoeDecoderForCausalLM(DecoderForCausalLM):
    supports_expert_parallel = True  # load_model passes expert_parallel only to a class that declares it

    def __init__(self, config, ops, plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE,
                 expert_parallel: bool = False):
        # Read by make_mlp while the base class builds the layers, so it is set first (a plain attribute:
        # nn.Module's own state does not exist yet).
        object.__setattr__(self, "expert_parallel", bool(expert_parallel) and tp.size > 1)
        super().__init__(config, ops, plan, tp)

    def sparse_block(self, config, ops, plan: FusionPlan, intermediate_size: int, **kwargs) -> SparseMoeBlock:
        """This rank's sparse block of ``intermediate_size``-wide experts (kwargs: shared expert, router dtype)."""
        return SparseMoeBlock(config.hidden_size, intermediate_size, RoutingConfig.from_hf_config(config), ops,
                              plan=plan, tp=self.tp, expert_parallel=self.expert_parallel, **kwargs)

    def dense_mlp(self, config, ops, plan: FusionPlan, intermediate_size: int) -> DenseMLP:
        """This rank's shard of a dense layer (``mlp_only_layers``, ``first_k_dense_replace``, ...)."""
        return DenseMLP(config, ops, intermediate_size=intermediate_size, plan=plan, tp=self.tp)
