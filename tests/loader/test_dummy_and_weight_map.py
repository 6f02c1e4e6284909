"""Dummy weights (deterministic, norms 1) and the declarative weight map."""

from __future__ import annotations

import torch
import transformers

from turnout.layers.norm import RMSNorm
from turnout.loader import load_model
from turnout.loader.weight_map import _compile_rules, map_weight_name
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform


def _config():
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=64, attention_bias=True)
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def test_dummy_is_deterministic_and_sane():
    ops = resolve(detect_platform("cpu"))
    a = load_model(_config(), load_format="dummy", device="cpu", ops=ops, seed=3).model
    b = load_model(_config(), load_format="dummy", device="cpu", ops=ops, seed=3).model
    c = load_model(_config(), load_format="dummy", device="cpu", ops=ops, seed=4).model
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    for m in a.modules():
        if isinstance(m, RMSNorm):
            assert torch.all(m.weight == 1)
    w = a.model.layers[0].self_attn.qkv_proj.weight
    assert 0.01 < w.std().item() < 0.03
    assert torch.all(a.model.layers[0].self_attn.qkv_proj.bias == 0)


def test_packed_names_map_to_shards():
    cfg = _config()
    model = load_model(cfg, load_format="dummy", device="cpu", ops=resolve(detect_platform("cpu"))).model
    rules = _compile_rules(model)
    assert map_weight_name("model.layers.1.self_attn.k_proj.bias", rules) == ("model.layers.1.self_attn.qkv_proj.bias", "k")
    assert map_weight_name("model.layers.0.mlp.up_proj.weight", rules) == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    assert map_weight_name("model.layers.0.self_attn.k_norm.weight", rules) == ("model.layers.0.self_attn.k_norm.weight", None)
    assert map_weight_name("model.norm.weight", rules) == ("model.norm.weight", None)
