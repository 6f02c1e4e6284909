"""A tiny checkpoint with a tokenizer, for the tests that drive the CLI with text (test_multinode, test_ray_executor)."""

from __future__ import annotations

import torch
import transformers


def write_tiny_model(path) -> str:
    """A tiny random Qwen3 (4 heads, 2 kv heads: splits over 2 ranks) with a word-level tokenizer t0..t319 (Qwen3:
    transformers' AutoTokenizer keeps a checkpoint's own tokenizer class for it; for qwen2 it would not)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.05
            p.copy_((1.0 + 2 * noise) if "norm" in name else 2 * noise)
    hf.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(320)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    return str(path)
