"""GPT-OSS (``GptOssForCausalLM``): the pre-norm decoder with

- attention on every layer with biased q/k/v/o projections (``attention_bias``), learned sinks (one logit per
  head, ``self_attn.sinks``), sliding-window layers (``sliding_window``, 128 tokens in the releases) alternating
  with full ones as ``layer_types`` says, YaRN rope (``rope_parameters``, computed by transformers' own rope
  functions: turnout/layers/rotary.py);
- on every layer a sparse block: a biased router (``mlp.router``: top-k of the logits, softmax over the k chosen)
  and experts with biased projections and the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``), through the
  ``moe_experts_biased`` op (turnout/layers/moe/biased.py for the checkpoint layout).

The released checkpoints store the experts in MXFP4 (``*_blocks`` / ``*_scales``); they are dequantised while they
load (turnout/quant/mxfp4.py), to the model dtype. Tensor and expert parallel as the other MoE families.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from turnout.distributed.parallel_state import SINGLE, TPGroup
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.moe.biased import BiasedExperts, BiasedRouter
from turnout.layers.moe.layer import SparseMoeBlock
from turnout.layers.moe.router import RoutingConfig
from turnout.models.layer_spec import LAYER_TYPES
from turnout.models.moe_decoder import MoeDecoderForCausalLM
from turnout.models.weight_map import load_weights
from turnout.quant.mxfp4 import dequantized_weights

logger = logging.getLogger(__name__)


# the released checkpoints' values, which older transformers' GptOssExperts hard-codes
SWIGLU_DEFAULTS = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def check_config(config) -> None:
    """What the layers are built from, checked against itself: ValueError naming the field."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is not None:
        types = list(types)
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries, but num_hidden_layers is {n}")
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
        window = getattr(config, "sliding_window", None)
        if "sliding_attention" in types and not window:
            raise ValueError(f"layer_types has sliding_attention layers, but sliding_window is {window!r}")
    for field, default in SWIGLU_DEFAULTS.items():
        value = getattr(config, field, None)
        if value is None:  # older transformers (5.17) has neither field: its experts hard-code these
            setattr(config, field, default)
        elif not float(value) > 0:
            raise ValueError(f"{field} must be a positive number, got {value!r}")


class GptOssForCausalLM(MoeDecoderForCausalLM):
    attention_sinks = True
    weight_name_rules = [
        # HF's router is mlp.router (weight and bias); the sparse block's is mlp.gate
        (r"(^|\.)mlp\.router\.(weight|bias)$", r"\g<1>mlp.gate.\g<2>", None),
    ]

    def __init__(self, config, ops, plan: FusionPlan = NO_FUSIONS, tp: TPGroup = SINGLE,
                 expert_parallel: bool = False):
        check_config(config)
        if plan.all_linear:  # batch-invariant mode (turnout/ops/batch_invariant.py)
            raise ValueError("batch_invariant: GPT-OSS's biased clamped-SwiGLU experts (moe_experts_biased) have no "
                             "batch-invariant implementation yet; run it with batch_invariant off")
        if plan.experts_quant is not None:  # said once, not per layer
            logger.info("GPT-OSS experts stay in the compute dtype: fp8 experts have no kernel for their biases and "
                        "clamped SwiGLU (the other linear layers are quantised)")
        super().__init__(config, ops, plan, tp, expert_parallel)

    def make_mlp(self, config, layer_idx: int, ops, plan: FusionPlan = NO_FUSIONS):
        # top-k of the biased logits, softmax over the k chosen: Mixtral's rule (softmax_after_topk)
        routing = RoutingConfig(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                                scoring="softmax", softmax_after_topk=True)
        experts = BiasedExperts(config.num_local_experts, config.hidden_size, config.intermediate_size, ops,
                                activation="clamped_swiglu", alpha=config.swiglu_alpha, limit=config.swiglu_limit,
                                tp=self.tp, expert_parallel=self.expert_parallel)
        return SparseMoeBlock(config.hidden_size, config.intermediate_size, routing, ops, plan=plan, tp=self.tp,
                              expert_parallel=self.expert_parallel,
                              gate=BiasedRouter(config.hidden_size, routing, ops=ops, plan=plan), experts=experts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # MXFP4 pairs become the unquantised stacks before the walk (the model dtype: one copy at a time)
        return load_weights(self, dequantized_weights(weights, self.model.embed_tokens.weight.dtype))
