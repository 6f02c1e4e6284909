"""EAGLE-3 draft heads (Li et al., 2025) for Llama-family targets, read from the published checkpoint layout
(yuhuili/EAGLE3-LLaMA3.1-Instruct-8B and the heads trained alike): a directory with a Llama-style config.json
(``architectures`` such as ``LlamaForCausalLMEagle3``, ``draft_vocab_size``, optionally ``target_hidden_size``,
``norm_before_residual``, ``eagle_aux_hidden_state_layer_ids``) and the tensors

- ``fc.weight`` [H, 3 Ht]: fuses the target's streams entering three of its layers (low, middle, high: by
  default 2, L // 2 and L - 3, vLLM's choice for EAGLE-3), concatenated, into one hidden state;
- ``midlayer.*``: one Llama decoder layer whose q/k/v projections read [input_layernorm(embedding),
  hidden_norm(hidden)] (2 H wide), with the un-normed hidden as its residual (``norm_before_residual``: the normed
  one), then ``post_attention_layernorm`` and the MLP;
- ``norm.weight``, ``lm_head.weight`` [draft_vocab_size, H]: logits over the draft vocabulary;
- ``d2t`` [draft_vocab_size] int: target id = draft id + d2t[draft id]; ``t2d`` [vocab] bool (which target ids
  the draft vocabulary has; checked, not used to draft);
- ``embed_tokens.weight`` where the head has its own; most share the target's embedding (no tensor).

Chained drafts feed the midlayer its own output stream (before ``norm``) as the hidden state, without ``fc``.
The head runs on the target's device and dtype, one rank; its attention cache is the proposer's
(turnout/engine/hidden_drafts.py).
"""

from __future__ import annotations

import torch
from torch import nn

from turnout.layers.embedding import VocabEmbedding
from turnout.layers.linear import QKVParallelLinear, ReplicatedLinear
from turnout.layers.norm import RMSNorm
from turnout.layers.rotary import get_rope
from turnout.models.decoder import DecoderAttention, DenseMLP, head_dim_of


def _bad(why: str) -> ValueError:
    return ValueError(f"speculative_config.model: {why}")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Layer(nn.Module):
    """The head's one decoder layer (checkpoint ``midlayer.``)."""

    def __init__(self, config, ops):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        rotary = get_rope(config, head_dim_of(config), config.max_position_embeddings, ops, is_neox=True)
        self.self_attn = DecoderAttention(config, ops, rotary, qkv_bias=False, o_bias=False, qk_norm=False)
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.self_attn.qkv_proj = QKVParallelLinear(2 * h, head_dim_of(config), config.num_attention_heads,
                                                    kv_heads, ops=ops)  # reads [embedding, hidden]
        self.mlp = DenseMLP(config, ops)
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps, ops), RMSNorm(h, eps, ops)
        self.post_attention_layernorm = RMSNorm(h, eps, ops)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, positions, embeds, hidden, kv_cache, meta) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = (normed if self.norm_before_residual else hidden).clone()  # the norms below work in place
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        out, residual = self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, meta), residual)
        return self.mlp(out) + residual


class Eagle3Head(nn.Module):
    """A DraftHead (engine/hidden_drafts.py) over an EAGLE-3 checkpoint; ``aux_layers``: the target layers whose
    input streams ``fc`` fuses, in order."""

    packed_modules_mapping = {"qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
                              "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)]}
    weight_name_rules: list = []
    ignored_weights: tuple[str, ...] = ()

    def __init__(self, config, ops, target_embedding: VocabEmbedding | None, aux_layers: tuple[int, ...]):
        super().__init__()
        h = config.hidden_size
        ht = getattr(config, "target_hidden_size", None) or h
        self.aux_layers = tuple(aux_layers)
        self.fc = ReplicatedLinear(len(aux_layers) * ht, h, bias=False, ops=ops)
        self.midlayer = Eagle3Layer(config, ops)
        self.norm = RMSNorm(h, config.rms_norm_eps, ops)
        self.lm_head = ReplicatedLinear(h, config.draft_vocab_size, bias=False, ops=ops)
        self.own_embedding = target_embedding is None
        if self.own_embedding:
            self.embed_tokens = VocabEmbedding(config.vocab_size, h, ops=ops)
        else:  # the target's (not a parameter of this module: not loaded, not counted twice)
            self.__dict__["embed_tokens"] = target_embedding
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long), persistent=False)

    def kv_spec(self, cache_dtype: str):
        return self.midlayer.self_attn.attn.kv_spec(cache_dtype)

    def first_hidden(self, captured: torch.Tensor) -> torch.Tensor:
        return self.fc(captured)

    def forward(self, input_ids, positions, hidden, kv_cache, meta) -> torch.Tensor:
        return self.midlayer(positions, self.embed_tokens(input_ids), hidden, kv_cache, meta)

    def draft(self, stream: torch.Tensor) -> torch.Tensor:
        d = self.lm_head(self.norm(stream)).argmax(-1)
        return d + self.d2t[d]
