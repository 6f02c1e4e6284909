"""GGUF tensor naming and fix-ups against transformers' own GGUF loading, per architecture.

A tiny random HF model is written as an F32 GGUF laid out as llama.cpp's converter lays it out (llama's
Q/K rows permuted, experts stacked). transformers reads the file back with its own GGUF support: its state
dict must equal the original (so the file is right), and turnout's ``iter_gguf_weights`` must yield exactly
the same tensors under the same names. F32 files load in every supported transformers (5.17 included).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

GGUFWriter = pytest.importorskip("gguf").GGUFWriter

from turnout.loader.gguf import NORM_SHIFTED, _hf_names, iter_gguf_weights

pytest.importorskip("accelerate")  # transformers' GGUF loading needs it

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _config(arch: str):
    if arch == "llama":
        return transformers.LlamaConfig(**COMMON, rope_theta=10000.0)
    if arch == "qwen2":
        return transformers.Qwen2Config(**COMMON, rope_theta=1e6)
    if arch == "qwen3":  # some transformers (5.24) read no head_dim from a qwen3 GGUF: their default (128) it is
        return transformers.Qwen3Config(**{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1},
                                        head_dim=128, rope_theta=1e6)
    if arch == "qwen3moe":  # GGUF says nothing of the expert size: transformers' default it is
        return transformers.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    raise AssertionError(arch)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: rows (head, half, i) written as (head, i, half)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, arch: str, path) -> None:
    """``model`` as an F32 GGUF in llama.cpp's layout for ``arch`` (tests/loader/test_gguf_families.py writes
    Gemma 2/3 and Phi-3 files with it too): llama's Q/K rows permuted, experts stacked, Gemma's norms stored as
    1 + w and a tied head left out."""
    cfg = model.config
    to_gguf = {hf: g for g, hf in _hf_names(arch).items()}
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch in NORM_SHIFTED:
        w.add_sliding_window(cfg.sliding_window)
    else:
        w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    if arch == "phi3":
        w.add_pad_token_id(0)  # else transformers' default (32000) is past the tiny vocabulary
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    for name, t in model.state_dict().items():
        stem, _, suffix = name.rpartition(".")
        if stem == "lm_head" and getattr(cfg, "tie_word_embeddings", False):
            continue  # tied: the file has no output tensor (llama.cpp's Gemma files)
        arr = t.float().numpy()
        if stem.endswith("mlp.experts") and suffix in ("gate_up_proj", "down_proj"):  # transformers 5: fused
            layer = stem.split(".")[2]
            parts = {"down": arr} if suffix == "down_proj" else dict(zip(("gate", "up"), np.split(arr, 2, axis=1)))
            for kind, a in parts.items():
                w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", np.ascontiguousarray(a))
            continue
        parts = stem.split(".")
        key = ".".join(parts[:2] + ["{bid}"] + parts[3:]) if stem.startswith("model.layers.") else stem
        gguf = to_gguf[key].format(bid=parts[2] if "{bid}" in key else "")
        if arch == "llama" and gguf.endswith(("attn_q", "attn_k")):
            arr = _permute(arr, cfg.num_attention_heads if gguf.endswith("q") else cfg.num_key_value_heads)
        if arch in NORM_SHIFTED and "norm" in stem:
            arr = arr + 1.0
        w.add_tensor(f"{gguf}.{suffix}", np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _stack_experts(ours: dict[str, torch.Tensor], hf_names) -> dict[str, torch.Tensor]:
    """Our per-expert tensors in the layout of the reference state dict (fused when transformers fuses)."""
    out = {k: v for k, v in ours.items() if ".experts." not in k}
    for name in hf_names:
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            prefix = name.rsplit(".", 1)[0]
            n = sum(1 for k in ours if k.startswith(prefix) and k.endswith(".down_proj.weight"))
            if name.endswith("down_proj"):
                out[name] = torch.stack([ours[f"{prefix}.{e}.down_proj.weight"] for e in range(n)])
            else:
                out[name] = torch.stack([torch.cat([ours[f"{prefix}.{e}.gate_proj.weight"],
                                                    ours[f"{prefix}.{e}.up_proj.weight"]]) for e in range(n)])
        elif ".experts." in name:
            out[name] = ours[name]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
def test_gguf_tensors_match_transformers(arch, tmp_path):
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(_config(arch)).eval()
    _write_gguf(original, arch, tmp_path / "tiny.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                           dtype=torch.float32)
    ref = hf.state_dict()
    for name, t in original.state_dict().items():
        assert torch.equal(ref[name], t), f"the test's GGUF writer and transformers disagree on {name}"
    config = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    ours = _stack_experts(dict(iter_gguf_weights(tmp_path / "tiny.gguf", config)), ref)
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert torch.equal(ours[name], t), name
