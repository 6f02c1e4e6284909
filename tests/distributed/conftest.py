"""Shared fixtures of the distributed tests."""

from __future__ import annotations

import pytest
import torch
import transformers


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random Qwen2 (2 layers, 4 query / 2 KV heads, vocab 320) saved as a checkpoint: TP=2 splits its KV heads
    one a rank. Weights: 1 + N(0, 0.1) for norms, N(0, 0.1) elsewhere."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.05
            p.copy_((1.0 + 2 * noise) if "norm" in name else 2 * noise)
    d = tmp_path_factory.mktemp("qwen2")
    hf.save_pretrained(d, safe_serialization=True)
    return str(d)
