"""FP8 MoE experts on CPU: a tiny random Qwen3-MoE in the Qwen3-30B-A3B-FP8 layout (per-expert fp8 weights
with 128 x 128 ``weight_scale_inv`` blocks; tests/quant/fp8_moe_checkpoints.py) against HF transformers, which reads
the same checkpoint and dequantises it itself; ``quantization="fp8"`` on the float model; dummy weights; the shards
of tensor and expert parallelism; what is refused.

HF is given the activation quantisation of the fp8 model (each decoder projection's input, and each expert's
hidden rows and SiLU-and-mul output, per token and 128 group with the reference ``quantize_fp8``), so the two differ
by float32 rounding: most rows exactly, the rest by an activation at an fp8 rounding tie (as tests/quant/test_fp8.py
explains). Without that mirror they differ by about a quarter of the logit range on this random model.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fp8_checkpoints import FORMATS, _ct, forward_logits, greedy_walk, rel_err
from fp8_moe_checkpoints import (
    MOE_FP8,
    make_moe_hf,
    quantize_activations_like_fp8,
    tiny_moe_config,
    write_fp8_moe_checkpoint,
)
from turnout.distributed.parallel_state import TPGroup
from turnout.layers.fusion import NO_FUSIONS
from turnout.loader import load_model
from turnout.loader.safetensors import iter_safetensors, safetensors_files
from turnout.models.registry import get_model_class
from turnout.ops.reference.fp8 import FP8, dequantize_weight
from turnout.ops.reference.moe_fp8 import dequantize_experts
from turnout.quant import experts_quant, linear_quant, quant_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, HF float model, the dequantised weights' state dict)."""
    d = tmp_path_factory.mktemp("qwen3_moe_fp8")
    hf = make_moe_hf()
    return d, hf, write_fp8_moe_checkpoint(hf, d).state_dict()


def _hf(config, state, dense: str = "fp8_block"):
    """A fresh HF model holding ``state``, its activations quantised as the fp8 model's."""
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ref.load_state_dict(state)
    quantize_activations_like_fp8(ref, dense)
    return ref


def _rows(ours, want):
    return (ours - want).abs().amax(dim=-1) / want.abs().max()


def _dequantised_hf_weights(model) -> dict[str, torch.Tensor]:
    """HF names -> float32 values of turnout's fp8 weights: the decoder projections (packed parts split back) and
    each MoE layer's expert stacks (HF keeps them stacked too: gate rows then up rows)."""
    out = {}
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, mod in model.named_modules():
        if getattr(mod, "quant", None) is None:
            continue
        if hasattr(mod, "gate_up_proj_scale_inv"):  # FusedExperts
            args = (mod.gate_up_proj, mod.gate_up_proj_scale_inv, mod.down_proj, mod.down_proj_scale_inv)
            stacks = [dequantize_experts(*args, e) for e in range(mod.num_local_experts)]
            out[name + ".gate_up_proj"] = torch.stack([s[0] for s in stacks])
            out[name + ".down_proj"] = torch.stack([s[1] for s in stacks])
            continue
        w = dequantize_weight(mod.weight, getattr(mod, mod.weight_scale_ref))
        leaf = name.rsplit(".", 1)[1]
        if leaf in parts:
            for part, (off, size) in zip(parts[leaf], mod.shard_offsets.values()):
                out[f"{name[: -len(leaf)]}{part}.weight"] = w[off:off + size]
        else:
            out[name + ".weight"] = w
    return out


def test_fp8_moe_checkpoint_equals_hf(checkpoint, ids, cpu_ops):
    d, _, mine = checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()  # HF dequantises
    theirs = hf.state_dict()
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in mine)  # the same layout
    loaded = load_model(str(d), ops=cpu_ops, device="cpu")
    block = loaded.model.model.layers[0].mlp
    assert block.experts.gate_up_proj.dtype == FP8 and block.experts.gate_up_proj_scale_inv.shape == (8, 4, 2)
    assert block.experts.down_proj_scale_inv.shape == (8, 2, 2) and block.gate.weight.dtype == torch.float32
    assert loaded.model.model.layers[1].mlp.down_proj.weight.dtype == FP8  # the dense layer between
    assert torch.equal(_dequantised_hf_weights(loaded.model)["model.layers.2.mlp.experts.down_proj"],
                       mine["model.layers.2.mlp.experts.down_proj"])
    ours = forward_logits(loaded.model, loaded.hf_config, ids)
    with torch.no_grad():
        plain = hf(ids[None]).logits[0]
    quantize_activations_like_fp8(hf)
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    rows = _rows(ours, want)
    assert (rows < 1e-5).float().mean() >= 0.5 and rows.max() < 0.05, rows
    assert rel_err(plain, want) > 5 * rows.median().item() + 1e-3  # the activation scheme is what is checked


def test_greedy_tokens_equal_hf_where_margins_are_clear(checkpoint, ids, cpu_ops):
    d, hf, state = checkpoint
    ref = _hf(hf.config, state)
    loaded = load_model(str(d), ops=cpu_ops, device="cpu")
    seq, hf_seq, margins, errors = greedy_walk(loaded, ref, ids[:8])
    assert min(margins) > 10 * max(errors), (margins, errors)
    assert torch.equal(seq, hf_seq)


@pytest.mark.parametrize("fmt", ["checkpoint", "online"])
def test_engine_greedy_equals_hf(fmt, checkpoint, ids, tmp_path):
    """Through LLM: the fp8 checkpoint, and LLM(quantization="fp8") on the float checkpoint (dense layers per channel,
    experts in 128 blocks), give HF's greedy tokens (HF holding the dequantised weights, activations quantised)."""
    from turnout import LLM, SamplingParams

    d, hf, state = checkpoint
    if fmt == "online":
        hf.save_pretrained(tmp_path)
        llm = LLM(str(tmp_path), device="cpu", quantization="fp8", kv_cache_memory=1 << 22)
        model = llm.engine.runner.model
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == FP8 and "gate_up_proj_scale_inv" in dict(experts.named_buffers())
        assert model.model.layers[0].self_attn.qkv_proj.weight_scale.shape[1] == 1  # dense layers per channel
        deq = _dequantised_hf_weights(model)
        assert rel_err(deq["model.layers.0.mlp.experts.gate_up_proj"],
                       hf.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]) < 0.07  # one e4m3 step or less
        ref = _hf(hf.config, {**hf.state_dict(), **deq}, dense="ct_channel_token")
    else:
        llm = LLM(str(d), device="cpu", kv_cache_memory=1 << 22)
        ref = _hf(hf.config, state)
    out = llm.generate_tokens(ids[:8].tolist(), SamplingParams(max_tokens=6, temperature=0))
    with torch.no_grad():
        want = ref.generate(ids[:8][None], max_new_tokens=6, do_sample=False)[0, 8:]
    assert list(out.token_ids) == want.tolist()


def _shard(config, ops, rank, **kw):
    plan = replace(NO_FUSIONS, linear_quant=linear_quant(config, None, ops),
                   experts_quant=experts_quant(config, None, ops))
    return get_model_class(config.architectures)(config, ops, plan, TPGroup(rank, 2, group=object()), **kw)


def test_tensor_and_expert_parallel_shards(checkpoint, cpu_ops):
    """Two ranks: split by the intermediate dim each holds its 128 rows of every expert's gate and up (and those
    columns of down) with their block scales; split by expert id, its four experts whole. Their dequantised values
    are the slices of the whole model's."""
    d = checkpoint[0]
    whole = load_model(str(d), ops=cpu_ops, device="cpu")
    full = _dequantised_hf_weights(whole.model)
    name = "model.layers.2.mlp.experts."
    gate_up, down = full[name + "gate_up_proj"], full[name + "down_proj"]
    for rank in range(2):
        tp = _shard(whole.hf_config, cpu_ops, rank)
        tp.load_weights(iter_safetensors(safetensors_files(d)))
        got = _dequantised_hf_weights(tp)
        gate, up = gate_up[:, :256], gate_up[:, 256:]
        rows = torch.cat([gate[:, rank * 128:(rank + 1) * 128], up[:, rank * 128:(rank + 1) * 128]], 1)
        assert torch.equal(got[name + "gate_up_proj"], rows)
        assert torch.equal(got[name + "down_proj"], down[:, :, rank * 128:(rank + 1) * 128])
        ep = _shard(whole.hf_config, cpu_ops, rank, expert_parallel=True)
        ep.load_weights(iter_safetensors(safetensors_files(d)))
        got = _dequantised_hf_weights(ep)
        assert torch.equal(got[name + "gate_up_proj"], gate_up[rank * 4:(rank + 1) * 4])
        assert torch.equal(got[name + "down_proj"], down[rank * 4:(rank + 1) * 4])
    # 2 x 64 rows would cut the checkpoint's 128-row blocks: refused when built; whole experts per rank are fine
    narrow = tiny_moe_config(moe_intermediate_size=128, quantization_config=MOE_FP8)
    with pytest.raises(ValueError, match=r"^quantization: a rank's slice of the MoE experts \(moe_intermediate_size "
                                         r"128 / tensor_parallel_size 2 = 64 rows\)"):
        _shard(narrow, cpu_ops, 1)
    ep = _shard(narrow, cpu_ops, 1, expert_parallel=True)
    assert ep.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 256, 256)


def test_dummy_fp8_moe_weights(cpu_ops):
    config = tiny_moe_config()
    loaded = load_model(config, load_format="dummy", ops=cpu_ops, device="cpu", quantization="fp8")
    w = _dequantised_hf_weights(loaded.model)["model.layers.0.mlp.experts.gate_up_proj"]
    assert loaded.model.model.layers[0].mlp.experts.gate_up_proj.dtype == FP8
    assert abs(w.std().item() - 0.02) < 0.002  # the spread of float dummy weights
    block = tiny_moe_config(quantization_config=MOE_FP8)
    m = load_model(block, load_format="dummy", ops=cpu_ops, device="cpu").model
    assert m.model.layers[2].mlp.experts.gate_up_proj_scale_inv.shape == (8, 4, 2)
    assert torch.isfinite(forward_logits(m, block, torch.arange(5))).all()


def test_compressed_tensors_block_checkpoint(checkpoint, ids, cpu_ops, tmp_path):
    """llm-compressor's FP8_BLOCK (block weights, dynamic activations per 128 group) names the scales
    ``weight_scale``: the same model loads from it."""
    d = checkpoint[0]
    tensors = load_file(str(d / "model.safetensors"))
    tensors = {k.replace(".weight_scale_inv", ".weight_scale"): v for k, v in tensors.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((d / "config.json").read_text())
    group = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True, "symmetric": True}
    qc = _ct("block", group)
    qc["config_groups"]["group_0"]["weights"]["block_structure"] = [128, 128]
    qc["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    ours = load_model(str(tmp_path), ops=cpu_ops, device="cpu")
    fp8 = load_model(str(d), ops=cpu_ops, device="cpu")
    assert torch.equal(forward_logits(ours.model, ours.hf_config, ids), forward_logits(fp8.model, fp8.hf_config, ids))


def test_what_is_refused_names_the_field(checkpoint, cpu_ops, tmp_path):
    token = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    block_token = _ct("block", token)
    block_token["config_groups"]["group_0"]["weights"]["block_structure"] = [128, 128]
    for qc, field in [(FORMATS["fp8_tensor_static"], "quantization_config.weight_block_size"),
                      (_ct("channel", token), "quantization_config.config_groups.group_0.weights.strategy"),
                      (block_token, "quantization_config.config_groups.group_0.input_activations")]:
        with pytest.raises(ValueError, match=rf"^{field}: fp8 MoE experts \(Qwen3MoeForCausalLM, num_experts=8\)"):
            quant_config(tiny_moe_config(quantization_config=qc))
    assert quant_config(tiny_moe_config(), "fp8").weights == "row"  # dense layers per channel; experts in blocks
    # a missing block scale names the parameter and the expert; a float expert weight names the tensor
    d = checkpoint[0]
    tensors = load_file(str(d / "model.safetensors"))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    missing = {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"mlp.experts.gate_up_proj_scale_inv \(shard \(3, 'up'\)\)"):
        load_model(str(tmp_path), ops=cpu_ops, device="cpu")
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.2.mlp.experts.5.down_proj.weight.*float8_e4m3fn"):
        load_model(str(tmp_path), ops=cpu_ops, device="cpu")
