"""Every registered architecture, built with a GPU's fusion plan, hands it to every block and projection: a
family hook that forgot ``plan=plan`` would silently run that block unfused on the GPU."""

import pytest
import torch
import transformers

from turnout.layers.embedding import LMHead
from turnout.layers.fusion import NO_FUSIONS, FusionPlan
from turnout.layers.linear import LinearBase
from turnout.layers.mla import MLAAttention
from turnout.layers.moe.layer import Router
from turnout.models.decoder import DecoderAttention, DecoderLayer
from turnout.models.registry import MODELS, get_model_class
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_shared_experts=1,
           first_k_dense_replace=1)
CONFIGS = {
    "LlamaForCausalLM": lambda: transformers.LlamaConfig(**SMALL),
    "MistralForCausalLM": lambda: transformers.MistralConfig(**SMALL, sliding_window=8),
    "Gemma2ForCausalLM": lambda: transformers.Gemma2Config(**SMALL, head_dim=8, sliding_window=8),
    "Gemma3ForCausalLM": lambda: transformers.Gemma3TextConfig(**SMALL, head_dim=8, sliding_window=8),
    "Olmo2ForCausalLM": lambda: transformers.Olmo2Config(**SMALL),
    "Qwen2ForCausalLM": lambda: transformers.Qwen2Config(**SMALL),
    "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(**SMALL, head_dim=8),
    "Qwen3MoeForCausalLM": lambda: transformers.Qwen3MoeConfig(**SMALL, **MOE, num_experts=4, head_dim=8),
    "Qwen2MoeForCausalLM": lambda: transformers.Qwen2MoeConfig(**SMALL, **MOE, num_experts=4,
                                                               shared_expert_intermediate_size=24),
    "MixtralForCausalLM": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    "Glm4MoeForCausalLM": lambda: transformers.Glm4MoeConfig(**SMALL, **MOE, n_routed_experts=8, n_group=2,
                                                             topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                                             head_dim=8),
    "Ernie4_5ForCausalLM": lambda: transformers.Ernie4_5Config(**SMALL, head_dim=8, use_bias=True),
    "Ernie4_5_MoeForCausalLM": lambda: transformers.Ernie4_5_MoeConfig(**SMALL, head_dim=8, moe_num_experts=4, moe_k=2,
                                                                       moe_intermediate_size=16),
    "Phi3ForCausalLM": lambda: transformers.Phi3Config(**SMALL, sliding_window=8, pad_token_id=0),
    # latent attention: its blocks take the layer's normed tensor (no q/k/v projection to fuse a norm into)
    **{arch: (lambda cls=cls, kw=kw: getattr(transformers, cls)(**SMALL, **MOE, **MLA, **kw)) for arch, cls, kw in (
        ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(q_lora_rank=None, n_routed_experts=4)),
        ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(q_lora_rank=16, n_routed_experts=8, n_group=2,
                                                           topk_group=1, num_nextn_predict_layers=1)),
        ("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig", dict(q_lora_rank=16, n_routed_experts=8)))},
    "GptOssForCausalLM": lambda: transformers.GptOssConfig(**SMALL, head_dim=8, num_local_experts=4,
                                                           num_experts_per_tok=2, sliding_window=8),
}
POST_NORM = {"Olmo2ForCausalLM"}
PLAN = FusionPlan(one_row_linear=True, prenorm_linear=True, prenorm_pays=lambda n, k: True, rope_attention=True)


def test_every_architecture_has_a_config_here():
    assert set(CONFIGS) == set(MODELS)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_the_plan_reaches_every_layer(arch):
    config = CONFIGS[arch]()
    ops = resolve(detect_platform("cpu"))
    cls = get_model_class([arch])
    with torch.device("meta"):
        model = cls(config, ops, PLAN)
        plain = cls(config, ops)
    assert model.plan is PLAN and plain.plan is NO_FUSIONS
    projections = [m for m in model.modules() if isinstance(m, (LinearBase, LMHead, Router))]
    assert projections and all(m.one_row_ops is ops for m in projections), \
        [n for n, m in model.named_modules() if m in projections and m.one_row_ops is None]
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    attention = [m for m in model.modules() if isinstance(m, (DecoderAttention, MLAAttention))]
    main = model.model.layers  # (a model's multi-token-prediction layers are layers too)
    assert len(main) == config.num_hidden_layers and all(m.self_attn in attention for m in main)
    # every layer with pre-norms fuses them (a post-norm layer has none: its blocks read the stream itself)
    prenormed = [m for m in layers if hasattr(m, "input_layernorm")]
    assert all(m.fuse_prenorms for m in prenormed)
    assert all(m.rope_attention is not None for m in attention if isinstance(m, DecoderAttention))
    assert len(prenormed) == len(layers) or arch in POST_NORM
    # the first projection of each block that takes a pending norm computes it
    assert all(m.self_attn.qkv_proj.takes_norm for m in prenormed if isinstance(m.self_attn, DecoderAttention))
    for m in plain.modules():
        assert getattr(m, "one_row_ops", None) is None and not getattr(m, "fuse_prenorms", False)
        assert getattr(m, "rope_attention", None) is None
