"""A checkpoint whose layer types, window, sinks or per-family tensors disagree with its config is refused with a
ValueError naming the config field or the checkpoint tensor, before a step runs: never a silent full-attention
layer, a truncated layer list, or a tensor loaded into the wrong rows."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from turnout.distributed import TPGroup
from turnout.loader import load_model
from turnout.models.registry import get_model_class
from turnout.models.weight_map import load_weights
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def ops():
    return resolve(detect_platform("cpu"))


def _build(arch, config, ops, **kw):
    with torch.device("meta"):
        return get_model_class([arch])(config, ops, **kw)


def _checkpoint(hf_cls, config, seed=0) -> dict:
    """A random checkpoint of transformers' own names and shapes for ``config``."""
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in hf_cls(config).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def test_a_sliding_layer_without_a_window_is_refused(ops):
    config = transformers.Gemma2Config(**SMALL, head_dim=8, sliding_window=8)
    config.sliding_window = None
    with pytest.raises(ValueError, match=r"layer_types\[0\] is 'sliding_attention' but sliding_window is None"):
        _build("Gemma2ForCausalLM", config, ops)


@pytest.mark.parametrize("n", [1, 3])
def test_layer_types_must_list_every_layer_once(n, ops):
    config = transformers.Gemma3TextConfig(**SMALL, head_dim=8, sliding_window=8)
    config.layer_types = ["sliding_attention"] * (n - 1) + ["full_attention"]
    with pytest.raises(ValueError, match=f"layer_types has {n} entries for num_hidden_layers 2"):
        _build("Gemma3ForCausalLM", config, ops)


def test_a_negative_window_is_refused(ops):
    config = transformers.MistralConfig(**SMALL, sliding_window=8)
    config.sliding_window = -3  # transformers' own field check takes any int
    with pytest.raises(ValueError, match="sliding_window must be a positive integer, got -3"):
        _build("MistralForCausalLM", config, ops)


def test_sinks_a_config_does_not_declare_are_refused_by_name(tmp_path, ops):
    """A checkpoint carrying attention sinks for a model family without them: load_model names the tensor."""
    config = transformers.MistralConfig(**SMALL, sliding_window=8, tie_word_embeddings=False)
    hf = transformers.MistralForCausalLM(config)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    from safetensors.torch import load_file, save_file

    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.self_attn.sinks"] = torch.zeros(4)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected checkpoint tensor 'model\.layers\.1\.self_attn\.sinks'"):
        load_model(str(tmp_path), device="cpu", ops=ops)


def test_sinks_of_the_wrong_size_are_refused_by_name(ops):
    from turnout.models.decoder import DecoderForCausalLM

    class WithSinks(DecoderForCausalLM):
        attention_sinks = True

    config = transformers.MistralConfig(**SMALL, sliding_window=8)
    weights = _checkpoint(transformers.MistralForCausalLM, config)
    weights.update({f"model.layers.{i}.self_attn.sinks": torch.zeros(4) for i in range(2)})
    weights["model.layers.1.self_attn.sinks"] = torch.zeros(3)  # 3 heads' sinks for a config of 4
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.sinks' \(3,\)"):
        load_weights(WithSinks(config, ops), weights.items())


def _ernie_moe_config():
    return transformers.Ernie4_5_MoeConfig(**SMALL, head_dim=8, moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                                           moe_layer_start_index=1)


def test_ernie_moe_correction_bias_must_match_the_experts(ops):
    config = _ernie_moe_config()
    weights = _checkpoint(transformers.Ernie4_5_MoeForCausalLM, config)
    name = "model.layers.1.mlp.gate.moe_statics.e_score_correction_bias"
    assert weights[name].shape == (1, 4)  # transformers' layout: one row per expert group
    load_weights(get_model_class(["Ernie4_5_MoeForCausalLM"])(config, ops), weights.items())
    bad = {**weights, name: torch.zeros(1, 5)}
    with pytest.raises(ValueError, match=re.escape(f"{name}' (1, 5)")):
        load_weights(get_model_class(["Ernie4_5_MoeForCausalLM"])(config, ops), bad.items())
    missing = {k: v for k, v in weights.items() if k != name}
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.gate\.e_score_correction_bias"):
        load_weights(get_model_class(["Ernie4_5_MoeForCausalLM"])(config, ops), missing.items())


@pytest.mark.parametrize("field,value,why", [("moe_layer_start_index", [1, 1], "must be an integer"),
                                             ("moe_layer_interval", 0, "must be >= 1")])
def test_ernie_moe_layer_range_fields_are_checked(field, value, why, ops):
    config = _ernie_moe_config()
    object.__setattr__(config, field, value)  # past transformers' own field check, as a hand-written config is
    with pytest.raises(ValueError, match=f"{field} {why}"):
        _build("Ernie4_5_MoeForCausalLM", config, ops)


def test_ernie_moe_with_biased_projections_is_refused_by_field(ops):
    config = _ernie_moe_config()
    config.use_bias = True
    with pytest.raises(ValueError, match="use_bias=True is not supported for Ernie4_5_MoeForCausalLM"):
        _build("Ernie4_5_MoeForCausalLM", config, ops)


@pytest.mark.parametrize("rank", [0, 1])
def test_phi3_packed_tensors_split_per_part_and_wrong_sizes_are_named(rank, ops):
    """Phi-3's packed qkv_proj / gate_up_proj under TP=2: each rank holds its share of q, of k and of v (and of
    gate and of up), cut out of the packed checkpoint tensor; a packed tensor sized for other heads is refused
    naming it."""
    config = transformers.Phi3Config(**SMALL, pad_token_id=0)
    weights = _checkpoint(transformers.Phi3ForCausalLM, config)
    tp = TPGroup(rank=rank, size=2, group=object())  # building and loading a shard make no collective call
    model = get_model_class(["Phi3ForCausalLM"])(config, ops, tp=tp)
    load_weights(model, weights.items())
    qkv = weights["model.layers.0.self_attn.qkv_proj.weight"]  # q 32 rows, k 16, v 16
    q, k, v = qkv.split([32, 16, 16])
    half = lambda t: t.chunk(2)[rank]  # noqa: E731
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, torch.cat([half(q), half(k), half(v)]))
    gate, up = weights["model.layers.0.mlp.gate_up_proj.weight"].chunk(2)
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight, torch.cat([half(gate), half(up)]))
    bad = {**weights, "model.layers.1.self_attn.qkv_proj.weight": torch.zeros(72, 32)}  # 72 rows: not the 64 of 4 + 2 + 2 heads of 8
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.qkv_proj\.weight' \(72, 32\)"):
        load_weights(get_model_class(["Phi3ForCausalLM"])(config, ops, tp=tp), bad.items())
