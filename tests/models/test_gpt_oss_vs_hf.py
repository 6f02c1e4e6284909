"""GPT-OSS against transformers on a tiny random model: sinks, biased projections, YaRN, sliding layers of a few
tokens alternating with full ones, the biased router and the clamped-SwiGLU experts; greedy generation far past
the window; the experts shipped in MXFP4 (packed here by a reference packer, checked against transformers' own
dequantisation) loaded and compared with HF holding the dequantised weights; checkpoints that disagree with their
config refused by name.

The tiny config makes each part count: expert weights and biases large enough that the clamp at ``swiglu_limit``
bites on a good share of the gate and up values (asserted), sinks of the size of the scores, a YaRN factor whose
original context is shorter than the generation.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from test_composed_families_vs_hf import greedy
from test_dense_vs_hf import BLOCK, rel_err, run_prefill_and_decode
from turnout.loader import load_model
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

WINDOW = 6
LIMIT = 3.0  # below the released 7.0 so that random tiny weights reach it


def tiny_config(window: int = WINDOW, **over):
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, sliding_window=window,
              max_position_embeddings=256, rms_norm_eps=1e-5, swiglu_limit=LIMIT, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    kw.update(over)
    return transformers.GptOssConfig(**kw)


def _randomise(hf_model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            scale = 0.1
            if "experts" in name:  # gate / up values of several units: the clamp at LIMIT is reached
                scale = 0.6 if "gate_up" in name else 0.2
            elif "sinks" in name:
                scale = 1.0
            noise = scale * torch.randn(p.shape, generator=gen)
            p.copy_(p + noise if "norm" in name else noise)


@pytest.fixture(scope="module")
def cpu_ops():
    return resolve(detect_platform("cpu"))


def _clamp_as_configured(hf) -> None:
    """transformers <= 5.17 has no swiglu_limit / swiglu_alpha in GptOssConfig and its experts clamp at the released
    7.0 with alpha 1.702 whatever config.json says; turnout reads config.json. Hold the peer to the config (the
    released checkpoints say 7.0 and 1.702, so both agree on them)."""
    want = {"limit": getattr(hf.config, "swiglu_limit", 7.0), "alpha": getattr(hf.config, "swiglu_alpha", 1.702)}
    for layer in hf.model.layers:
        for attr, value in want.items():
            setattr(layer.mlp.experts, attr, value)


def make(tmp_path, seed: int = 0, **over):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config(**over), dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    _clamp_as_configured(hf)
    _randomise(hf, seed)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf


def _clamp_share(hf, prompt) -> float:
    """The share of gate/up values of layer 0's chosen experts past the limit (so the clamp is tested)."""
    seen = []
    experts = hf.model.layers[0].mlp.experts

    def hook(mod, args):
        x, idx = args[0], args[1]
        for e in idx.unique():
            gu = x @ mod.gate_up_proj[e] + mod.gate_up_proj_bias[e]
            seen.append((gu[..., ::2] > LIMIT).float().mean().item() + (gu[..., 1::2].abs() > LIMIT).float().mean().item())

    h = experts.register_forward_pre_hook(hook)
    with torch.no_grad():
        hf(prompt[None])
    h.remove()
    return sum(seen) / len(seen)


def test_prefill_and_decode_match_hf(tmp_path, cpu_ops):
    hf = make(tmp_path)
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), ops=cpu_ops)
    assert type(loaded.model).__name__ == "GptOssForCausalLM"
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (5, 17, 9)]  # 17 crosses a KV block and windows
    assert _clamp_share(hf, prompts[1]) > 0.05
    prefill, next_ids, decode = run_prefill_and_decode(loaded.model, loaded.hf_config, prompts, "cpu", torch.float32)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            assert rel_err(prefill[b], hf(p[None]).logits[0]) < 1e-4, f"prefill seq {b}"
            ref_next = hf(torch.cat([p, next_ids[b: b + 1]])[None]).logits[0, -1]
            assert rel_err(decode[b], ref_next) < 1e-4, f"decode seq {b}"


def _check_greedy(hf, model, config, prompts, steps=32):
    for n, prompt in enumerate(prompts):
        tokens, logits = greedy(model, config, prompt, steps)
        with torch.no_grad():
            ref = hf.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=steps, min_new_tokens=steps)[0, len(prompt):]
            full = hf(torch.cat([prompt, torch.tensor(tokens)])[None]).logits[0, len(prompt) - 1: -1]
        assert tokens == ref.tolist(), f"prompt {n}"
        assert len(set(tokens)) > steps // 6, f"prompt {n}: a varied continuation, so equal tokens say something"
        for i in range(steps):
            assert rel_err(logits[i], full[i]) < 1e-4, f"prompt {n} step {i}"


def test_greedy_32_tokens_far_past_the_window_match_hf(tmp_path, cpu_ops):
    """Three prompts, 32 greedy tokens each (windows of 6, KV blocks of 16): HF's generate's tokens, and every
    step's logits within 1e-4 of HF's over the same tokens."""
    hf = make(tmp_path, seed=2)
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), ops=cpu_ops)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (3, 7, BLOCK + 4)]
    _check_greedy(hf, loaded.model, loaded.hf_config, prompts)


def test_the_parts_reach_the_layers(tmp_path, cpu_ops):
    make(tmp_path)
    model = load_model(str(tmp_path), device="cpu", ops=cpu_ops).model
    attn = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attn] == [WINDOW, None, WINDOW, None]
    assert all(a.has_sinks for a in attn)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.bias is not None and layer.self_attn.o_proj.bias is not None
    assert layer.mlp.gate.bias is not None and layer.mlp.experts.limit == LIMIT
    assert cpu_ops.chosen("moe_experts_biased") is not None


# --- MXFP4 -------------------------------------------------------------------------------------------------------

_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A reference packer, written from the OCP MX spec independently of the loader: w [E, rows, cols] (out x in,
    cols a multiple of 32) -> (blocks uint8 [E, rows, cols/32, 16], scales uint8 [E, rows, cols/32]); each block
    of 32 shares 2 ** (s - 127), the smallest power of two that brings its max |w| within 6, the values rounded
    to the nearest e2m1 magnitude, the sign in bit 3, two codes a byte, the even element in the low nibble."""
    e, rows, cols = w.shape
    g = w.reshape(e, rows, cols // 32, 32).float()
    amax = g.abs().amax(-1).clamp(min=2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp)[..., None]
    mag = (scaled.abs()[..., None] - _FP4).abs().argmin(-1)  # [.., 32] index 0..7
    codes = (mag | ((scaled < 0) & (mag > 0)).to(torch.long) << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def write_mxfp4_checkpoint(src, dst) -> dict[str, torch.Tensor]:
    """The unquantised checkpoint at ``src`` rewritten as GPT-OSS ships it: each expert stack as *_blocks and
    *_scales of its [E, out, in] transpose, ``quantization_config`` mxfp4. Returns the packed tensors."""
    tensors = load_file(f"{src}/model.safetensors")
    packed = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = pack_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    save_file({**tensors, **packed}, f"{dst}/model.safetensors", metadata={"format": "pt"})
    config = json.load(open(f"{src}/config.json"))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(config, open(f"{dst}/config.json", "w"))
    return packed


def test_mxfp4_checkpoint_loads_and_equals_hf_on_the_dequantised_weights(tmp_path, cpu_ops):
    """The peer is transformers loading the same MXFP4 checkpoint itself (``Mxfp4Config(dequantize=True)``, its
    own conversion code): its expert weights equal our dequantiser's bit for bit, and its greedy tokens and logits
    equal ours."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from turnout.quant.mxfp4 import dequantize_mxfp4

    (tmp_path / "bf").mkdir()
    (tmp_path / "q").mkdir()
    hf_bf = make(tmp_path / "bf", seed=4)
    packed = write_mxfp4_checkpoint(tmp_path / "bf", tmp_path / "q")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "q"), dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    _clamp_as_configured(hf)
    with torch.no_grad():
        for layer_idx, (layer, layer_bf) in enumerate(zip(hf.model.layers, hf_bf.model.layers)):
            for proj in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{layer_idx}.mlp.experts.{proj}"
                blocks, scales = packed[f"{name}_blocks"], packed[f"{name}_scales"]
                theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
                assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs), name
                assert torch.equal(getattr(layer.mlp.experts, proj), theirs), name
                # the packer is faithful: within a quarter of the largest weight, and really quantised
                original = getattr(layer_bf.mlp.experts, proj)
                assert (theirs - original).abs().max() <= original.abs().max() / 4, name
                assert not torch.equal(theirs, original)
    loaded = load_model(str(tmp_path / "q"), device="cpu", ops=cpu_ops)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (4, 11, 8)]
    _check_greedy(hf, loaded.model, loaded.hf_config, prompts, steps=12)


def test_mxfp4_half_of_a_pair_is_refused_by_name(tmp_path, cpu_ops):
    (tmp_path / "bf").mkdir()
    (tmp_path / "q").mkdir()
    make(tmp_path / "bf")
    write_mxfp4_checkpoint(tmp_path / "bf", tmp_path / "q")
    tensors = load_file(f"{tmp_path}/q/model.safetensors")
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, f"{tmp_path}/q/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.down_proj_blocks .*down_proj_scales"):
        load_model(str(tmp_path / "q"), device="cpu", ops=cpu_ops)


# --- checkpoints that disagree with their config ---------------------------------------------------------------

def test_sinks_of_the_wrong_shape_are_refused_naming_the_tensor(tmp_path, cpu_ops):
    make(tmp_path)
    tensors = load_file(f"{tmp_path}/model.safetensors")
    tensors["model.layers.1.self_attn.sinks"] = torch.zeros(8)  # 8 entries for 4 heads
    save_file(tensors, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.sinks.*\(8,\)"):
        load_model(str(tmp_path), device="cpu", ops=cpu_ops)


def test_missing_sinks_are_refused_naming_the_tensor(tmp_path, cpu_ops):
    make(tmp_path)
    tensors = load_file(f"{tmp_path}/model.safetensors")
    del tensors["model.layers.3.self_attn.sinks"]
    save_file(tensors, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.3\.self_attn\.attn\.sinks"):
        load_model(str(tmp_path), device="cpu", ops=cpu_ops)


@pytest.mark.parametrize("edit,field", [
    ({"layer_types": ["sliding_attention", "full_attention"] * 3}, "layer_types"),  # 6 entries for 4 layers
    ({"layer_types": ["sliding_attention", "full_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"swiglu_limit": 0.0}, "swiglu_limit"),
])
def test_a_config_that_disagrees_with_itself_is_refused_naming_the_field(tmp_path, cpu_ops, edit, field):
    make(tmp_path)
    config = json.load(open(f"{tmp_path}/config.json"))
    config.update(edit)
    json.dump(config, open(f"{tmp_path}/config.json", "w"))
    with pytest.raises(ValueError, match=field):
        load_model(str(tmp_path), device="cpu", ops=cpu_ops)


def test_the_model_checks_a_config_object_too(cpu_ops):
    """A config object mutated after transformers validated it (or built without validation) meets the model's own
    check, which names the field."""
    from turnout.models.registry import get_model_class

    cls = get_model_class(["GptOssForCausalLM"])
    for field, value in (("layer_types", ["sliding_attention", "full_attention"]), ("sliding_window", 0),
                         ("swiglu_alpha", -1.0)):
        config = tiny_config()
        object.__setattr__(config, field, value)
        with torch.device("meta"), pytest.raises(ValueError, match=field):
            cls(config, cpu_ops)


# --- the Triton kernels (the interpreter on CPU), and the GPU -----------------------------------------------------

@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "gpu-plan"])
def test_gpt_oss_through_the_triton_kernels_matches_hf(fused, tmp_path):
    """GPT-OSS on the Triton implementations: paged attention with sinks over windows of 6 (prompts of 5, 17 and
    9 tokens: the window slides inside the prefill and across a KV block), the biased clamped-SwiGLU experts
    (moe_experts_biased), the routing; with a GPU's plan the decode step's one-row projections take the biases and
    the pre-norms, and rope, the cache write and windowed attention with sinks run in one kernel."""
    from turnout.layers.fusion import NO_FUSIONS, FusionPlan
    from turnout.ops import Policy

    platform = detect_platform("cpu")
    if not platform.triton_usable()[0]:
        pytest.skip("Triton does not run here")
    ops = resolve(platform, Policy.parse("prefer=triton"))
    for op in ("paged_attention", "rotary_paged_attention", "moe_experts_biased", "select_experts"):
        assert ops.chosen(op) == "triton.default", op
    hf = make(tmp_path, seed=3)
    plan = (FusionPlan(one_row_linear=True, prenorm_linear=True, prenorm_pays=lambda n, k: True, rope_attention=True)
            if fused else NO_FUSIONS)
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), ops=ops, plan=plan)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (5, 17, 9)]
    lens = prompts if not fused else prompts[:1]  # the fused decode path is the batch-1 one
    prefill, next_ids, decode = run_prefill_and_decode(loaded.model, loaded.hf_config, lens, "cpu", torch.float32)
    with torch.no_grad():
        for b, p in enumerate(lens):
            assert rel_err(prefill[b], hf(p[None]).logits[0]) < 1e-4, f"prefill seq {b}"
            ref_next = hf(torch.cat([p, next_ids[b: b + 1]])[None]).logits[0, -1]
            assert rel_err(decode[b], ref_next) < 1e-4, f"decode seq {b}"


def test_batch_invariant_mode_is_refused_by_name(cpu_ops):
    """No batch-invariant implementation of the biased experts exists yet: refused, not silently variant."""
    from turnout.layers.fusion import FusionPlan
    from turnout.models.registry import get_model_class

    with torch.device("meta"), pytest.raises(ValueError, match="batch_invariant"):
        get_model_class(["GptOssForCausalLM"])(tiny_config(), cpu_ops, FusionPlan(all_linear=True))


@pytest.mark.gpu
def test_bf16_on_gpu_matches_hf_past_the_window(tmp_path):
    """The GPU's op table and fusion plan (Triton attention with sinks and windows, the biased experts' grouped
    kernels, one-row projections with biases and fused pre-norms, rope in the decode attention kernel): every
    step's logits of a generation several windows and KV blocks long within bf16 error of HF's float32 forward over
    the same tokens."""
    from test_dense_vs_hf import decode_meta, kv_caches, prefill_meta
    from turnout.layers.fusion import plan_fusions

    plat = detect_platform()
    ops, dev = resolve(plat), plat.device(0)
    hf = make(tmp_path, seed=2).to(device=dev)
    loaded = load_model(str(tmp_path), device=dev, ops=ops, dtype="bfloat16", plan=plan_fusions(ops))
    assert ops.chosen("moe_experts_biased") == "triton.default"
    prompt = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(3))
    steps = 3 * BLOCK + 5
    meta, positions, nb = prefill_meta([len(prompt)], dev, extra=steps)
    caches = kv_caches(loaded.hf_config, nb, torch.bfloat16, dev)
    model = loaded.model
    with torch.inference_mode():
        logits = [model.compute_logits(model(prompt.to(dev), positions, caches, meta))[-1]]
        tokens = [int(logits[-1].argmax())]
        for _ in range(steps - 1):
            dmeta, dpos = decode_meta([len(prompt) + len(tokens) - 1], meta.block_tables, dev)
            logits.append(model.compute_logits(model(torch.tensor(tokens[-1:], device=dev), dpos, caches, dmeta))[0])
            tokens.append(int(logits[-1].argmax()))
        full = hf(torch.cat([prompt, torch.tensor(tokens)])[None].to(dev)).logits[0, len(prompt) - 1: -1]
    errs = [rel_err(logits[i], full[i]) for i in range(steps)]
    assert max(errs) < 5e-2 and sum(errs) / steps < 2e-2, [round(e, 4) for e in errs]


def test_fp8_quantises_the_linear_layers_and_keeps_the_experts(tmp_path, cpu_ops):
    """``quantization="fp8"``: the projections become fp8 (with their biases), the biased clamped-SwiGLU experts,
    which no fp8 kernel computes, stay in the compute dtype, holding exactly HF's weights (never plain fp8 SwiGLU
    experts). (No logits bound against HF here: this tiny model's routing flips under any weight perturbation;
    HF's own forward moves by ~50 % when only its attention weights are rounded to fp8.)"""
    hf = make(tmp_path, seed=6)
    model = load_model(str(tmp_path), device="cpu", ops=cpu_ops, quantization="fp8").model
    for i, layer in enumerate(model.model.layers):
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        assert layer.self_attn.qkv_proj.bias is not None and layer.self_attn.o_proj.bias is not None
        experts, theirs = layer.mlp.experts, hf.model.layers[i].mlp.experts
        assert type(experts).__name__ == "BiasedExperts" and experts.gate_up_proj.dtype == torch.float32
        assert torch.equal(experts.down_proj, theirs.down_proj.transpose(1, 2))
        assert torch.equal(experts.gate_up_proj[:, :32], theirs.gate_up_proj[..., 0::2].transpose(1, 2))
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(7)) for n in (6, 11)]
    prefill, _, decode = run_prefill_and_decode(model, hf.config, prompts, "cpu", torch.float32)
    assert all(torch.isfinite(x).all() for x in (*prefill, decode))


def test_mxfp4_quantization_config_is_gpt_oss_only():
    """An MXFP4 ``quantization_config`` means GPT-OSS's dequantised-at-load experts: nothing else is quantised (or
    ``quantization="fp8"`` quantises the projections at load); on another family it is refused by name."""
    from turnout.quant import quant_config

    gpt_oss = tiny_config()
    gpt_oss.quantization_config = {"quant_method": "mxfp4"}
    assert quant_config(gpt_oss) is None
    assert quant_config(gpt_oss, "fp8").source == "quantised at load"
    llama = transformers.LlamaConfig(num_hidden_layers=1)
    llama.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match="quantization_config.quant_method"):
        quant_config(llama)
