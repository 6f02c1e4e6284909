"""From logits to tokens: penalties and min_tokens in torch, then the `sample` op, plus logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-lane sampling inputs, built by the model runner (one lane = one token to draw)."""

    rows: torch.Tensor  # [L] int64: which logits row each lane samples from
    temperature: torch.Tensor  # [L] f32
    top_k: torch.Tensor  # [L] i32
    top_p: torch.Tensor  # [L] f32
    min_p: torch.Tensor  # [L] f32
    seeds: torch.Tensor  # [L] i64
    steps: torch.Tensor  # [L] i64
    # Penalties (None when no lane has any): token histories as padded id matrices (-1 = pad).
    presence: torch.Tensor | None = None  # [L] f32
    frequency: torch.Tensor | None = None  # [L] f32
    repetition: torch.Tensor | None = None  # [L] f32
    output_ids: torch.Tensor | None = None  # [L, maxlen] i64
    prompt_ids: torch.Tensor | None = None  # [L, maxlen] i64
    # Token ids to forbid per lane (min_tokens not reached: EOS and stop ids): [L, m] i64, -1 = pad.
    banned: torch.Tensor | None = None
    max_logprobs: int = 0  # top-N logprobs to return (0: only when a lane asked, the sampled one)
    want_logprobs: bool = False


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids.clamp_min(-1) % (vocab + 1), torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]  # the pad (-1) lands in column `vocab`, dropped


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    vocab = logits.shape[-1]
    if b.output_ids is not None:
        out_counts = _counts(b.output_ids, vocab)
        seen = out_counts > 0
        if b.prompt_ids is not None:
            seen = seen | (_counts(b.prompt_ids, vocab) > 0)
        rep = b.repetition[:, None]
        # HF/vLLM repetition penalty: divide positive logits, multiply negative ones, on seen tokens.
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - b.frequency[:, None] * out_counts - b.presence[:, None] * (out_counts > 0).float()
    if b.banned is not None:
        mask = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
        mask.scatter_(1, b.banned % (vocab + 1), True)
        logits = logits.masked_fill(mask[:, :vocab], float("-inf"))
    return logits


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [L] i64
    logprobs: torch.Tensor | None = None  # [L] f32, the sampled token's logprob
    ranks: torch.Tensor | None = None  # [L] i64, its rank (1 = most likely)
    top_ids: torch.Tensor | None = None  # [L, N]
    top_logprobs: torch.Tensor | None = None  # [L, N]


def sample(ops, logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    """logits: [R, V] float32 (one row per sequence that reached its end this step)."""
    logits = logits.index_select(0, b.rows) if logits.shape[0] != b.rows.shape[0] else logits
    raw = logits
    if b.output_ids is not None or b.banned is not None:
        logits = apply_penalties(logits, b)
    tokens = ops.sample(logits.contiguous(), b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps)
    out = SamplerOutput(tokens)
    if b.want_logprobs:
        # Logprobs of the model's distribution (before penalties and temperature), as vLLM's default.
        lp = torch.log_softmax(raw.float(), dim=-1)
        chosen = lp.gather(1, tokens[:, None])[:, 0]
        out.logprobs = chosen
        out.ranks = (lp > chosen[:, None]).sum(-1) + 1
        if b.max_logprobs > 0:
            out.top_logprobs, out.top_ids = lp.topk(b.max_logprobs, dim=-1)
    return out
