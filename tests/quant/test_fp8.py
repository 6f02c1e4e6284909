"""FP8 weights on CPU: tiny random llama / qwen3 models written in each fp8 checkpoint format
(tests/quant/fp8_checkpoints.py) against HF transformers holding the exact dequantised weights.

Weight-only formats must equal that reference to float32 rounding. Where activations are quantised too, HF
is given the same activation quantisation (the reference ``quantize_fp8`` in a pre-hook on each decoder
linear), so the comparison stays tight and checks the scheme (per token, per 128 group, static); without it
the fp8 activations move the logits of these models by 10-18 % of their range. Online ``quantization="fp8"``
is checked the same way against the weights it made, and loosely against the unquantised model.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fp8_checkpoints import (
    FORMATS,
    WEIGHT_ONLY,
    fake_quant_activations,
    forward_logits,
    greedy_walk,
    make_hf,
    rel_err,
    write_fp8_checkpoint,
)
from turnout.config import EngineConfig
from turnout.distributed.parallel_state import TPGroup
from turnout.loader import load_model
from turnout.loader.safetensors import iter_safetensors, safetensors_files
from turnout.models.registry import get_model_class
from turnout.ops.reference.fp8 import FP8, dequantize_weight
from turnout.quant import quant_config


@pytest.fixture(scope="module")
def hf_models():
    return {kind: make_hf(kind) for kind in ("llama", "qwen3")}


def _checkpoint(hf_models, kind, fmt, ids, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"{kind}_{fmt}")
    ref = write_fp8_checkpoint(hf_models[kind], fmt, d, ids)
    return d, ref


def _row_errors(ours, ref):
    scale = ref.abs().max()
    return ((ours - ref).abs().amax(dim=-1) / scale)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_equals_the_dequantised_model(kind, fmt, hf_models, ids, cpu_ops, tmp_path_factory):
    d, ref = _checkpoint(hf_models, kind, fmt, ids, tmp_path_factory)
    with torch.no_grad():
        plain = ref(ids[None]).logits[0]  # dequantised weights, float activations
    fake_quant_activations(ref, fmt, d)
    loaded = load_model(str(d), ops=cpu_ops, device="cpu")
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and loaded.model.lm_head.weight.dtype == torch.float32
    ours = forward_logits(loaded.model, loaded.hf_config, ids)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    rows = _row_errors(ours, want)
    if fmt in WEIGHT_ONLY:
        assert rows.max() < 1e-5 and torch.equal(plain, want)
        return
    # An activation a hair from an fp8 rounding tie may round the other way in one of the two (float32 sums in
    # another order): one element moves one fp8 step. Most rows stay exact, none moves far.
    assert (rows < 1e-5).float().mean() >= 0.5, rows
    assert rows.max() < 0.05, rows
    assert rel_err(plain, want) > 5 * rows.median().item() + 1e-3  # the activation scheme is what is checked


@pytest.mark.parametrize("fmt", ["ct_channel_weight_only", "fp8_tensor_dynamic"])
def test_greedy_tokens_equal_hf(fmt, hf_models, ids, cpu_ops, tmp_path_factory):
    d, ref = _checkpoint(hf_models, "llama", fmt, ids, tmp_path_factory)
    fake_quant_activations(ref, fmt, d)
    loaded = load_model(str(d), ops=cpu_ops, device="cpu")
    seq, hf_seq, margins, errors = greedy_walk(loaded, ref, ids[:8])
    assert min(margins) > 10 * max(errors), (margins, errors)  # the margins are clear at this precision
    assert torch.equal(seq, hf_seq)


def _dequantised_hf_weights(model) -> dict[str, torch.Tensor]:
    """HF names -> float32 values of turnout's fp8 decoder linears (packed parts split back)."""
    out = {}
    for name, mod in model.named_modules():
        if getattr(mod, "quant", None) is None:
            continue
        w = dequantize_weight(mod.weight, getattr(mod, mod.weight_scale_ref))
        parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        leaf = name.rsplit(".", 1)[1]
        if leaf in parts:
            for part, (off, size) in zip(parts[leaf], mod.shard_offsets.values()):
                out[f"{name[: -len(leaf)]}{part}.weight"] = w[off:off + size]
        else:
            out[name + ".weight"] = w
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_online_fp8_matches_its_weights_and_stays_near_the_float_model(kind, hf_models, ids, cpu_ops, tmp_path):
    hf = hf_models[kind]
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), ops=cpu_ops, device="cpu", quantization="fp8")
    ours = forward_logits(loaded.model, loaded.hf_config, ids)
    ref = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
    ref.load_state_dict({**hf.state_dict(), **_dequantised_hf_weights(loaded.model)})
    fake_quant_activations(ref, "ct_channel_token")
    with torch.no_grad():
        want, plain = ref(ids[None]).logits[0], hf(ids[None]).logits[0]
    rows = _row_errors(ours, want)
    assert (rows < 1e-5).float().mean() >= 0.5 and rows.max() < 0.05, rows
    assert rel_err(ours, plain) < 0.3  # fp8 weights and activations on a random model: within 30 % of the range
    assert (ours.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.5


@pytest.mark.parametrize("fmt", ["fp8_block", "ct_channel_token", "fp8_tensor_static"])
def test_tensor_parallel_shards_hold_slices_of_the_scales(fmt, hf_models, ids, cpu_ops, tmp_path_factory):
    """Each rank of two loads its slice: per-row scales with their rows, block scales by block, the static input
    scale whole; its dequantised weights are the slice of the whole model's."""
    d, _ = _checkpoint(hf_models, "qwen3", fmt, ids, tmp_path_factory)
    whole = load_model(str(d), ops=cpu_ops, device="cpu").model
    config = whole.config
    cls = get_model_class(config.architectures)
    full = _dequantised_hf_weights(whole)
    for rank in range(2):
        from dataclasses import replace

        from turnout.layers.fusion import NO_FUSIONS
        from turnout.quant import linear_quant

        plan = replace(NO_FUSIONS, linear_quant=linear_quant(config, None, cpu_ops))
        shard = cls(config, cpu_ops, plan, TPGroup(rank, 2, group=object()))
        shard.load_weights(iter_safetensors(safetensors_files(d)))
        for name, w in _dequantised_hf_weights(shard).items():
            row_split = name.endswith(("o_proj.weight", "down_proj.weight"))
            n = w.shape[1] if row_split else w.shape[0]
            want = full[name].narrow(1 if row_split else 0, rank * n, n)
            assert torch.equal(w, want), name
        if fmt == "fp8_tensor_static":
            scales = load_file(str(d / "model.safetensors"))
            got = shard.model.layers[1].self_attn.qkv_proj.input_scale
            assert got.item() == max(scales[f"model.layers.1.self_attn.{p}_proj.input_scale"].item() for p in "qkv")


def test_online_tensor_parallel_shards_are_slices_of_one_rank(hf_models, cpu_ops, tmp_path):
    """quantization="fp8" at TP=2: each rank quantises the whole float row before taking its slice, so a
    row-parallel rank's part of K keeps the row's one scale and both ranks hold exactly the slices of the one-rank
    model's weights (with scales from each rank's slice they were another, equally valid, quantisation)."""
    from dataclasses import replace

    from turnout.layers.fusion import NO_FUSIONS
    from turnout.quant import linear_quant

    hf_models["qwen3"].save_pretrained(tmp_path)
    whole = load_model(str(tmp_path), ops=cpu_ops, device="cpu", quantization="fp8").model
    config = whole.config
    full = _dequantised_hf_weights(whole)
    for rank in range(2):
        plan = replace(NO_FUSIONS, linear_quant=linear_quant(config, "fp8", cpu_ops))
        shard = get_model_class(config.architectures)(config, cpu_ops, plan, TPGroup(rank, 2, group=object()))
        shard.load_weights(iter_safetensors(safetensors_files(tmp_path)))
        got = _dequantised_hf_weights(shard)
        assert got.keys() == full.keys()
        for name, w in got.items():
            row_split = name.endswith(("o_proj.weight", "down_proj.weight"))
            n = w.shape[1] if row_split else w.shape[0]
            assert torch.equal(w, full[name].narrow(1 if row_split else 0, rank * n, n)), name


def test_dummy_fp8_weights(cpu_ops):
    config = make_hf("qwen3").config
    config.architectures = ["Qwen3ForCausalLM"]
    loaded = load_model(config, load_format="dummy", ops=cpu_ops, device="cpu", quantization="fp8")
    w = _dequantised_hf_weights(loaded.model)["model.layers.0.mlp.down_proj.weight"]
    assert loaded.model.model.layers[0].mlp.down_proj.weight.dtype == FP8
    assert abs(w.std().item() - 0.02) < 0.002  # the same spread as float dummy weights
    block = type(config).from_dict({**config.to_dict(), "quantization_config": FORMATS["fp8_block"]})
    m = load_model(block, load_format="dummy", ops=cpu_ops, device="cpu").model
    assert m.model.layers[0].self_attn.qkv_proj.weight_scale_inv.shape == (8, 2)
    assert torch.isfinite(forward_logits(m, block, torch.arange(5))).all()


@pytest.mark.parametrize("fmt", ["fp8_tensor_dynamic", "online"])
def test_engine_greedy_equals_hf(fmt, hf_models, ids, cpu_ops, tmp_path_factory):
    """Through LLM (scheduler, paged cache, sampler): an fp8 checkpoint, and LLM(quantization="fp8") on the
    float checkpoint, give HF's greedy tokens (HF holding the dequantised weights, activations quantised)."""
    from turnout import LLM, SamplingParams

    if fmt == "online":
        d = tmp_path_factory.mktemp("llama_float")
        hf_models["llama"].save_pretrained(d)
        llm = LLM(str(d), device="cpu", quantization="fp8", kv_cache_memory=1 << 22)
        ref = transformers.AutoModelForCausalLM.from_config(hf_models["llama"].config, dtype=torch.float32).eval()
        ref.load_state_dict({**hf_models["llama"].state_dict(),
                             **_dequantised_hf_weights(llm.engine.runner.model)})
        fake_quant_activations(ref, "ct_channel_token")
    else:
        d, ref = _checkpoint(hf_models, "llama", fmt, ids, tmp_path_factory)
        fake_quant_activations(ref, fmt, d)
        llm = LLM(str(d), device="cpu", kv_cache_memory=1 << 22)
    out = llm.generate_tokens(ids[:8].tolist(), SamplingParams(max_tokens=6, temperature=0))
    with torch.no_grad():
        want = ref.generate(ids[:8][None], max_new_tokens=6, do_sample=False)[0, 8:]
    assert list(out.token_ids) == want.tolist()


def test_bad_quantization_names_the_field(hf_models, ids, cpu_ops, tmp_path):
    with pytest.raises(ValueError, match="^quantization: unknown method 'int4'"):
        EngineConfig(quantization="int4")
    moe = transformers.Qwen3MoeConfig(num_experts=4, architectures=["Qwen3MoeForCausalLM"],
                                      quantization_config=FORMATS["fp8_tensor_dynamic"])  # experts need blocks
    with pytest.raises(ValueError, match=r"^quantization_config.weight_block_size: fp8 MoE experts \(Qwen3Moe"):
        quant_config(moe)
    for field, value, match in [("weight_block_size", [64, 64], "quantization_config.weight_block_size"),
                                ("quant_method", "bitsandbytes", "quantization_config.quant_method"),
                                ("modules_to_not_convert", ["model.layers.0.mlp.down_proj"],
                                 "quantization_config.modules_to_not_convert")]:
        with pytest.raises(ValueError, match=match):
            quant_config(transformers.LlamaConfig(quantization_config={**FORMATS["fp8_block"], field: value}))
    # block scales need block-aligned packed parts: k / v of 2 x 32 rows are not
    odd = make_hf("qwen3", head_dim=32, num_key_value_heads=2)
    write_fp8_checkpoint(odd, "fp8_block", tmp_path, ids)
    with pytest.raises(ValueError, match="quantization: QKVParallelLinear part 'k'"):
        load_model(str(tmp_path), ops=cpu_ops, device="cpu")
    # a float weight where the config promises fp8 is refused, naming the tensor
    d = tmp_path / "mixed"
    d.mkdir()
    write_fp8_checkpoint(hf_models["llama"], "ct_channel_token", d, ids)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].float()
    save_file(tensors, str(d / "model.safetensors"))
    assert json.loads((d / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight.*float8_e4m3fn"):
        load_model(str(d), ops=cpu_ops, device="cpu")
