"""The cos/sin cache equals what HF's rotary embedding computes, for every rope type we build."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from turnout.layers.rotary import get_rope
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_cache_matches_hf(name):
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512,
                                   rope_theta=50000.0, rope_scaling=SCALINGS[name])
    rope = get_rope(cfg, 64, cfg.max_position_embeddings, ops=None)
    pos = torch.arange(512)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos)  # [1, P, D]
    half = rope.rotary_dim // 2
    assert rope.rotary_dim == 64 and rope.cos_sin_cache.dtype == torch.float32
    torch.testing.assert_close(rope.cos_sin_cache[:, :half], cos[0, :, :half], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope.cos_sin_cache[:, half:], sin[0, :, :half], rtol=1e-6, atol=1e-6)


def test_partial_rotary_factor_rotates_a_prefix():
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=32)
    cfg.partial_rotary_factor = 0.5
    ops = resolve(detect_platform("cpu"))
    rope = get_rope(cfg, 64, 32, ops)
    assert rope.rotary_dim == 32 and rope.cos_sin_cache.shape == (32, 32)
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    q0, k0 = q.clone(), k.clone()
    rope(torch.tensor([0, 5, 9]), q, k)
    assert torch.equal(q[..., 32:], q0[..., 32:]) and torch.equal(k[..., 32:], k0[..., 32:])
    assert torch.equal(q[0], q0[0])  # position 0 is the identity
    assert not torch.allclose(q[1, :, :32], q0[1, :, :32])


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_rope_per_layer_type_matches_gemma3(layer_type):
    """Rope set per layer type (transformers 5 nests ``rope_parameters`` by type): each type's cache equals HF's
    Gemma 3 rotary embedding for that type: the sliding layers' base, the global layers' scaled rope. A config
    in the older spelling (``rope_local_base_freq`` beside a flat ``rope_theta`` / ``rope_scaling``, which
    transformers 5 converts when it reads one) gives the same caches."""
    from types import SimpleNamespace

    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=2, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    rope = get_rope(cfg, 16, 256, ops=None, layer_type=layer_type)
    cos, sin = Gemma3RotaryEmbedding(cfg)(torch.zeros(1), torch.arange(256)[None], layer_type)
    torch.testing.assert_close(rope.cos_sin_cache[:, :8], cos[0, :, :8], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope.cos_sin_cache[:, 8:], sin[0, :, :8], rtol=1e-6, atol=1e-6)
    old = SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                          rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                          rope_local_base_freq=1e4, layer_types=cfg.layer_types)
    if layer_type == "sliding_attention":  # the flat spelling's global rope needs transformers' own config object
        torch.testing.assert_close(get_rope(old, 16, 256, ops=None, layer_type=layer_type).cos_sin_cache,
                                   rope.cos_sin_cache, rtol=0, atol=0)
