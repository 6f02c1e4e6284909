"""A DeepSeek-V3-shaped tiny model written here as a 128 x 128 block-fp8 checkpoint in DeepSeek-V3's layout (every
MLA projection, dense MLP, shared and routed expert fp8 with ``weight_scale_inv``; routers, norms, embedding and
head in float), against transformers holding the exact dequantised weights with the same activation quantisation
(per token and 128 group before every fp8 projection and expert GEMM, as the fp8 model does).

``kv_b_proj`` is the exception: turnout dequantises it as it loads and runs attention in the absorbed form (its
weight read as per-head matrices, no activation quantised), so transformers' kv_b_proj keeps an unquantised input
too. The q/kv latent projections (q_a_proj, kv_a_proj_with_mqa) go through the same fp8 linear layers as any
projection."""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from fp8_checkpoints import fake_quant_activations  # noqa: E402
from fp8_moe_checkpoints import _quantised_experts_forward  # noqa: E402
from turnout.kv.spec import CacheLayout  # noqa: E402
from turnout.layers.attention import AttentionMetadata  # noqa: E402
from turnout.loader import load_model  # noqa: E402
from turnout.ops import resolve  # noqa: E402
from turnout.ops.reference.fp8 import FP8, dequantize_weight, quantize_weight  # noqa: E402
from turnout.platforms.detect import detect_platform  # noqa: E402
from turnout.worker.kv_sizing import allocate_caches  # noqa: E402

QUANTISED = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)"
                       r"\.weight$")
BLOCK_CFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _hf():
    cfg = transformers.DeepseekV3Config(
        vocab_size=384, hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else noise * (0.3 if name.endswith("mlp.gate.weight") or
                                                                      p.dim() == 1 else p.shape[-1] ** -0.5))
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
    return hf


def _write(hf, out):
    tensors, deq = {}, {}
    for name, w in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            base = name.rsplit(".", 1)[0]
            parts = [("gate_proj", 0), ("up_proj", 1)] if name.endswith("gate_up_proj") else [("down_proj", None)]
            inter = w.shape[1] // 2
            stacked = []
            for e in range(w.shape[0]):
                rows = []
                for part, half in parts:
                    piece = w[e] if half is None else w[e, half * inter:(half + 1) * inter]
                    q, s = quantize_weight(piece, "block")
                    tensors[f"{base}.{e}.{part}.weight"], tensors[f"{base}.{e}.{part}.weight_scale_inv"] = q, s
                    rows.append(dequantize_weight(q, s))
                stacked.append(torch.cat(rows))
            deq[name] = torch.stack(stacked)
        elif QUANTISED.search(name):
            q, s = quantize_weight(w, "block")
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = q, s
            deq[name] = dequantize_weight(q, s)
        else:
            tensors[name] = w.contiguous()
    out.mkdir(exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = BLOCK_CFG
    (out / "config.json").write_text(json.dumps(config))
    ref = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    ref.load_state_dict({**hf.state_dict(), **deq})
    # the fp8 model's activation quantisation, on every fp8 projection but kv_b_proj (absorbed: see the docstring)
    fake_quant_activations(ref, "fp8_block")  # hooks q/k/v/o/gate/up/down_proj inputs by name
    for name, mod in ref.named_modules():
        if isinstance(mod, torch.nn.Linear) and re.search(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa)$", name):
            mod.register_forward_pre_hook(lambda m, args: (_fq(args[0]),))
        if type(mod).__name__ == "DeepseekV3Experts":
            mod.forward = _quantised_experts_forward.__get__(mod)
    return ref


def _fq(x):
    from turnout.ops.reference.fp8 import dequantize_act, quantize_fp8

    x2 = x.reshape(-1, x.shape[-1])
    return dequantize_act(*quantize_fp8(x2, 128)).to(x.dtype).reshape(x.shape)


def _logits(model, ids):
    n = len(ids)
    nb = -(-n // 16)
    caches = allocate_caches(CacheLayout(tuple(model.kv_specs("float32"))), nb, 16, 1, "cpu")
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange(nb, dtype=torch.int32)[None],
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n, max_seq_len=n)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


def test_block_fp8_checkpoint_equals_transformers_w8a8(tmp_path):
    hf = _hf()
    ref = _write(hf, tmp_path / "ckpt")
    model = load_model(str(tmp_path / "ckpt"), dtype=torch.float32, device="cpu",
                       ops=resolve(detect_platform("cpu"))).model
    attn = model.model.layers[1].self_attn
    for proj in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj):
        assert proj.weight.dtype == FP8 and proj.weight_scale_inv.dtype == torch.float32
    assert attn.kv_b_proj.weight.dtype == torch.float32  # dequantised at load
    ids = torch.randint(0, 384, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = _logits(model, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    rel = ((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1))
    print(f"fp8 block MLA vs transformers W8A8: max relative logit error {rel.max():.3g}")
    assert rel.max() < 1e-4, f"max relative logit error {rel.max():.3g} (median {rel.median():.3g})"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_a_kv_b_proj_without_its_block_scales_is_refused(tmp_path):
    from safetensors.torch import load_file

    hf = _hf()
    _write(hf, tmp_path / "ckpt")
    tensors = load_file(tmp_path / "ckpt" / "model.safetensors")
    del tensors["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.kv_b_proj\.weight_scale_inv"):
        load_model(str(tmp_path / "ckpt"), dtype=torch.float32, device="cpu", ops=resolve(detect_platform("cpu")))
