"""4-bit checkpoints on CPU: tiny random llama / qwen3 models written as AWQ, GPTQ (with and without desc_act) and
compressed-tensors W4A16 (tests/quant/w4_checkpoints.py) equal HF transformers holding the exact dequantised
weights (logits within 1e-4 of their range, greedy tokens identical); the packers match each format's published
layout; bad checkpoints and methods are refused naming the tensor or the field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_checkpoints import forward_logits, greedy_walk, make_hf
from turnout.loader import load_model
from turnout.quant import quant_config
from w4_checkpoints import AWQ_ORDER, FORMATS, ct_pack, pack_words, write_w4_checkpoint


@pytest.fixture(scope="module")
def hf_models():
    return {kind: make_hf(kind) for kind in ("llama", "qwen3")}


def test_packers_follow_the_published_layouts():
    cols = torch.arange(8)[None]  # one row of eight values 0..7
    # AutoAWQ: nibble i holds column AWQ_ORDER[i] -> 0x75316420; GPTQ / compressed-tensors: in order -> 0x76543210
    assert pack_words(cols, AWQ_ORDER).item() == 0x75316420
    assert pack_words(cols).item() == 0x76543210
    assert pack_words(torch.full((1, 8), 15)).item() == -1  # all bits set, as int32
    assert ct_pack(cols - 8).item() == 0x76543210  # signed values are stored + 8


def test_ct_packer_equals_upstream():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    gen = torch.Generator().manual_seed(0)
    v = torch.randint(-8, 8, (24, 64), generator=gen)
    for dim in (0, 1):
        ours = pack_words((v + 8) if dim == 1 else (v + 8).T)
        ours = ours if dim == 1 else ours.T
        assert torch.equal(ours, helpers.pack_to_int32(v.to(torch.int8), 4, dim))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_w4_checkpoint_equals_the_dequantised_model(kind, fmt, hf_models, ids, cpu_ops, tmp_path_factory):
    if kind == "qwen3" and fmt not in ("awq", "gptq_desc_act", "ct_w4a16_asym_actorder"):
        pytest.skip("one model family covers the rest")
    d = tmp_path_factory.mktemp(f"{kind}_{fmt}")
    ref = write_w4_checkpoint(hf_models[kind], fmt, d)
    loaded = load_model(str(d), ops=cpu_ops, device="cpu")
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert getattr(qkv, qkv.w4_names["qweight"]).dtype == torch.uint8 and not hasattr(qkv, "weight")
    ours = forward_logits(loaded.model, loaded.hf_config, ids)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    assert ((ours - want).abs().max() / want.abs().max()).item() < 1e-4
    seq, hf_seq, margins, _ = greedy_walk(loaded, ref, ids[:8], steps=4)
    assert torch.equal(seq, hf_seq), margins


def test_quantization_flag_names_the_method(hf_models, tmp_path_factory):
    d = tmp_path_factory.mktemp("awq_flag")
    write_w4_checkpoint(hf_models["llama"], "awq", d)
    cfg = json.loads((d / "config.json").read_text())
    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(str(d))
    assert quant_config(hf_cfg, "awq").fmt == "awq"
    with pytest.raises(ValueError, match="quantization: 'gptq' does not match .* 'awq'"):
        quant_config(hf_cfg, "gptq")
    with pytest.raises(ValueError, match="quantization: unknown method 'bitsandbytes'"):
        quant_config(hf_cfg, "bitsandbytes")
    plain = AutoConfig.from_pretrained(str(d))
    del plain.quantization_config
    with pytest.raises(ValueError, match="quantization: 'awq' reads a checkpoint quantised that way"):
        quant_config(plain, "awq")
    for key, value, field in [("bits", 8, "quantization_config.bits"),
                              ("group_size", -1, "quantization_config.group_size"),
                              ("version", "gemv", "quantization_config.version")]:
        bad = dict(cfg["quantization_config"], **{key: value})
        hf_cfg.quantization_config = bad
        with pytest.raises(ValueError, match=field):
            quant_config(hf_cfg, None)
    hf_cfg.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match="quant_method: 'bitsandbytes' is not supported"):
        quant_config(hf_cfg, None)


@pytest.mark.parametrize("fmt,tensor,cut", [("awq", "scales", 1), ("gptq", "qweight", 0), ("ct_w4a16", "weight_scale", 1)])
def test_packed_tensor_disagreeing_with_its_scales_is_refused(fmt, tensor, cut, hf_models, cpu_ops, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"bad_{fmt}")
    write_w4_checkpoint(hf_models["llama"], fmt, d)
    tensors = load_file(str(d / "model.safetensors"))
    name = f"model.layers.1.mlp.down_proj.{tensor}"
    t = tensors[name]
    tensors[name] = t.narrow(cut, 0, t.shape[cut] // 2).contiguous()  # a group size the packed weight does not have
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}.*{tensor} .* disagrees"):
        load_model(str(d), ops=cpu_ops, device="cpu")


def _dequantised_layers(model) -> dict[str, torch.Tensor]:
    """{module name: its float32 weight [N, K] in the input's column order} of every 4-bit layer."""
    from turnout.ops.reference.w4a16 import dequantize_w4

    out = {}
    for name, mod in model.named_modules():
        names = getattr(mod, "w4_names", None)
        if names is None:
            continue
        w = dequantize_w4(getattr(mod, names["qweight"]), getattr(mod, names["scales"]), mod.quant.config.group_size)
        if mod.act_perm is not None:
            w = torch.empty_like(w).index_copy_(1, mod.act_perm, w)
        out[name] = w
    return out


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct_w4a16_asym_actorder"])
def test_tensor_parallel_shards_hold_slices_of_whole_groups(fmt, hf_models, cpu_ops, tmp_path_factory):
    """Each of two ranks loads its slice: column layers whole 64-row blocks of every packed part, row layers whole
    groups of K; its dequantised weights are the slice of the one-rank model's."""
    from dataclasses import replace

    from turnout.distributed.parallel_state import TPGroup
    from turnout.layers.fusion import NO_FUSIONS
    from turnout.loader.safetensors import iter_safetensors, safetensors_files
    from turnout.models.registry import get_model_class
    from turnout.quant import linear_quant

    d = tmp_path_factory.mktemp(f"tp_{fmt}")
    write_w4_checkpoint(hf_models["qwen3"], fmt, d)
    whole = load_model(str(d), ops=cpu_ops, device="cpu").model
    config = whole.config
    full = _dequantised_layers(whole)
    plan = replace(NO_FUSIONS, linear_quant=linear_quant(config, None, cpu_ops))
    if fmt == "ct_w4a16_asym_actorder":  # activation order scatters a group over K: a row layer cannot split K
        with pytest.raises(ValueError, match="activation order"):
            get_model_class(config.architectures)(config, cpu_ops, plan, TPGroup(0, 2, group=object()))
        return
    for rank in range(2):
        shard = get_model_class(config.architectures)(config, cpu_ops, plan, TPGroup(rank, 2, group=object()))
        shard.load_weights(iter_safetensors(safetensors_files(d)))
        got = _dequantised_layers(shard)
        assert got.keys() == full.keys()
        for name, w in got.items():
            mod = dict(whole.named_modules())[name]
            if name.endswith(("o_proj", "down_proj")):
                want = full[name].narrow(1, rank * w.shape[1], w.shape[1])
            else:  # each packed part's rows of this rank, back to back
                parts = getattr(mod, "shard_offsets", {None: (0, w.shape[0] * 2)})
                sizes = getattr(mod, "shard_sizes", {None: w.shape[0] * 2})
                want = torch.cat([full[name].narrow(0, off + rank * (sizes[sid] // 2), sizes[sid] // 2)
                                  for sid, (off, _) in parts.items()])
            assert torch.equal(w, want), name


@pytest.mark.parametrize("fmt,flag", [("gptq_desc_act", "gptq"), ("ct_w4a16", None)])
def test_engine_greedy_equals_hf(fmt, flag, hf_models, ids, tmp_path_factory):
    """Through LLM (scheduler, paged cache, sampler, K-major CPU re-layout skipping 4-bit layers), with vLLM's
    --quantization spelling or without it: HF's greedy tokens on the dequantised weights."""
    from turnout import LLM, SamplingParams

    d = tmp_path_factory.mktemp(f"engine_{fmt}")
    ref = write_w4_checkpoint(hf_models["llama"], fmt, d)
    llm = LLM(str(d), device="cpu", quantization=flag, kv_cache_memory=1 << 22)
    out = llm.generate_tokens(ids[:8].tolist(), SamplingParams(max_tokens=6, temperature=0))
    with torch.no_grad():
        want = ref.generate(ids[:8][None], max_new_tokens=6, do_sample=False)[0, 8:]
    assert list(out.token_ids) == want.tolist()


def test_dummy_weights_fill_the_4bit_parameters(cpu_ops):
    """--load-format dummy with a 4-bit quantization_config (the GPU benchmark's AWQ model): finite logits whose
    spread is that of N(0, 0.02) weights."""
    from fp8_checkpoints import tiny_config
    from w4_checkpoints import FORMATS as W4

    cfg = tiny_config("qwen3", architectures=["Qwen3ForCausalLM"], quantization_config=W4["awq"][0])
    m = load_model(cfg, load_format="dummy", ops=cpu_ops, device="cpu").model
    qkv = m.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.uint8 and qkv.qweight.float().std() > 50
    logits = forward_logits(m, cfg, torch.arange(6))
    assert torch.isfinite(logits).all() and logits.std() > 0
