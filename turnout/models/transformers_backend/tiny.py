"""Tiny random models of transformers architectures, for the model-level conformance check (`turnout models
--check`) and the tests: a config per architecture (2 layers, hidden 64), the HF model with every parameter
randomised, saved as a safetensors checkpoint, and HF's own greedy tokens and logits to compare with."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2,
              # MoE sizes under the names the families give them (a name a config does not have is just set on it)
              num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=64)

# What a model type's config needs beyond COMMON (names it spells its own way, features worth exercising).
OVERRIDES = {
    "gpt2": dict(n_inner=128), "gptj": dict(rotary_dim=8, n_inner=128), "codegen": dict(rotary_dim=8, n_inner=128),
    "gpt_bigcode": dict(n_inner=128, multi_query=True), "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "gemma2": dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=20, attn_logit_softcapping=30.0,
                   final_logit_softcapping=20.0),
    "cohere2": dict(sliding_window=4), "gemma": dict(head_dim=16),
    "persimmon": dict(partial_rotary_factor=0.5), "phi": dict(partial_rotary_factor=0.5),
    "stablelm": dict(partial_rotary_factor=0.25), "granite": dict(logits_scaling=4.0, attention_multiplier=0.2,
                                                                  residual_multiplier=0.5, embedding_multiplier=3.0),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, attn_config={"kv_n_heads": 2},
                 ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}),
    "jetmoe": dict(kv_channels=16, num_local_experts=4, num_experts_per_tok=2),
    "starcoder2": dict(sliding_window=8),
}

PROMPTS = [[1, 5, 9, 3, 17, 2], [7, 2, 44], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]]


def tiny_config(model_type: str, **extra):
    return transformers.AutoConfig.for_model(model_type, **{**COMMON, **OVERRIDES.get(model_type, {}), **extra})


def randomise(hf_model, seed: int) -> None:
    """HF initialises biases to 0 and norms to 1 (or 0 for 1 + w norms); random values make every parameter count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_((1.0 + noise) if "norm" in name and p.dim() == 1 else noise)


MAX_PARAMS = 20_000_000  # a config whose sizes live in a sub-config COMMON does not reach is not tiny


def save_tiny(model_type: str, path, seed: int = 0, **extra):
    """The HF model of ``model_type`` (randomised, float32, eval) saved as a checkpoint under ``path``. A ValueError
    when the config COMMON makes is not tiny (its sizes in a sub-config): counted on the meta device first."""
    config = tiny_config(model_type, **extra)
    with torch.device("meta"):
        n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{model_type}: the tiny config still has {n / 1e6:.0f}M parameters (its sizes are in a "
                         "sub-config): not checked")
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomise(hf, seed)
    hf.save_pretrained(path)
    return hf


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation of ``prompt`` (n tokens, no cache: every step a full forward, so nothing of HF's
    cache code is assumed) and the logits at the last position of the prompt."""
    ids = list(prompt)
    first = None
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], first
