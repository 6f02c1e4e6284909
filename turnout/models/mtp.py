"""The multi-token-prediction layers some checkpoints carry past ``num_hidden_layers`` (DeepSeek-V3, GLM-4.5):
kept, for a speculative decoder to draft with, rather than dropped.

Layer i (checkpoint ``model.layers.{num_hidden_layers + i}``) predicts the token after next from the main
model's last hidden state h at position p (the residual stream after its last layer, before the final norm: the
norms here are the layer's own, ``hnorm``) and the embedding of the token at p + 1:
``x = eh_proj([enorm(embed(token)), hnorm(h)])``, one decoder layer of the family (``block``: its attention and
MoE), then ``shared_head.norm`` and ``shared_head.head`` give logits. Its own ``embed_tokens`` and head are
stored in the checkpoint and loaded here.

Not in the causal LM's step: the family's ``kv_specs`` lists only the main layers. The "mtp" speculative method
(turnout/engine/hidden_drafts.py) keeps the layer's attention cache (``(latent_cache,)`` for MLA) and passes it.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from turnout.layers.embedding import LMHead, VocabEmbedding
from turnout.layers.fusion import FusionPlan
from turnout.layers.linear import ReplicatedLinear
from turnout.models.decoder_layer import DecoderLayer

# a layer's own parts; anything else of it (self_attn, mlp, its two norms) belongs to its decoder layer
_OWN_PARTS = ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head")


def mtp_layer_name(name: str, num_hidden_layers: int, count: int) -> str:
    """A checkpoint name of an MTP layer (``model.layers.{num_hidden_layers + i}.``) -> ours (``mtp.layers.{i}.``,
    the decoder layer's parts under ``block.``); any other name unchanged."""
    m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
    if m is None or not num_hidden_layers <= int(m.group(1)) < num_hidden_layers + count:
        return name
    i, rest = int(m.group(1)) - num_hidden_layers, m.group(2)
    part = rest.split(".", 1)[0]
    return f"mtp.layers.{i}.{rest}" if part in _OWN_PARTS else f"mtp.layers.{i}.block.{rest}"


def checkpoint_names(text: str, num_hidden_layers: int) -> str:
    """``text`` (an error message) with our MTP parameter names written as the checkpoint names them."""
    return re.sub(r"\bmtp\.layers\.(\d+)\.(?:block\.)?",
                  lambda m: f"model.layers.{num_hidden_layers + int(m.group(1))}.", text)


class MTPLayer(nn.Module):
    def __init__(self, config, ops, family, plan: FusionPlan, layer_idx: int):
        super().__init__()
        h = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, h, tp=family.tp, ops=ops)
        self.enorm, self.hnorm = family.make_norm(), family.make_norm()
        self.eh_proj = ReplicatedLinear(2 * h, h, bias=False, ops=ops, plan=plan)
        rotary = family.model.layers[0].self_attn.rotary_emb  # one cos/sin cache for every layer
        self.block = DecoderLayer(family.make_attention(config, layer_idx, ops, rotary, plan),
                                  family.make_mlp(config, layer_idx, ops, plan), config, ops, plan,
                                  norm=family.make_norm)
        self.shared_head = nn.Module()
        self.shared_head.norm = family.make_norm()
        self.shared_head.head = LMHead(config.vocab_size, h, tp=family.tp, ops=ops, plan=plan)

    def forward(self, input_ids, positions, previous_hidden, kv_cache, meta) -> torch.Tensor:
        """input_ids [T] (the tokens at p + 1), previous_hidden [T, H] (the main model's stream at p, before its
        final norm; or this layer's own output, chaining drafts) -> this layer's stream [T, H], before
        ``shared_head.norm``; logits: ``compute_logits``."""
        x = torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(previous_hidden)], dim=-1)
        hidden, residual = self.block(positions, self.eh_proj(x), None, kv_cache, meta)
        return hidden + residual

    def compute_logits(self, stream: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(stream))


class MultiTokenPredictor(nn.Module):
    def __init__(self, config, ops, family, plan: FusionPlan, count: int):
        super().__init__()
        n = config.num_hidden_layers
        self.num_layers = count
        self.layers = nn.ModuleList(MTPLayer(config, ops, family, plan, n + i) for i in range(count))
