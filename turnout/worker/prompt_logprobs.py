"""``SamplingParams.prompt_logprobs``: the logprob of every prompt token after the first, and the top-k
there, from the model's logits at the position before it (vLLM's meaning; position 0 has none).

The model runner computes logits for the rows that sample only; a step with entries asking for prompt
logprobs also computes them for the rows that predict one of their prompt tokens (``logit_rows``), in
the same ``compute_logits`` call, so a tensor-parallel LM head gathers the same rows on every rank.
Chunked prefill gives a request its positions in several steps; each step's chunk names its first
position, and the output processor writes them in place, so a recomputed prompt (after a preemption)
overwrites with the same values. A request asking for them bypasses the prefix cache
(``Sequence.skip_prefix_cache``): a cached position would never be computed.

Values are of the raw distribution (no temperature, penalties or masks), as vLLM's default and as the
sampled tokens' logprobs. The host copy is taken lazily (``PromptLogprobChunk.rows``), when the output
processor reads the chunk after the step's own sync, so a prefill step is not made to wait here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class PromptLogprobChunk:
    """One request's prompt logprobs from one step: positions ``first`` .. ``first + len(targets) - 1``."""

    kind: ClassVar[str] = "prompt_logprobs"
    request_id: str
    first: int  # the prompt position of the first target token (>= 1)
    targets: list[int]  # the prompt tokens at those positions
    k: int  # top-k asked for
    logprobs: torch.Tensor  # [R] f32: each target's logprob
    ranks: torch.Tensor  # [R] i64: its rank (1 = most likely)
    top_ids: torch.Tensor | None  # [R, k]
    top_logprobs: torch.Tensor | None  # [R, k]

    def rows(self) -> list[tuple[int, int, float, int, list[tuple[int, float]]]]:
        """Host values: (position, target token, its logprob, its rank, top-k [(token, logprob)])."""
        lps, ranks = self.logprobs.tolist(), self.ranks.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else [[] for _ in lps]
        tops = self.top_logprobs.tolist() if self.top_logprobs is not None else [[] for _ in lps]
        return [(self.first + i, t, lp, r, list(zip(ti, tl))[: self.k])
                for i, (t, lp, r, ti, tl) in enumerate(zip(self.targets, lps, ranks, ids, tops))]


@dataclass
class PromptRows:
    """Which rows of a step's flattened batch predict a prompt token of a request asking for them."""

    spans: list[tuple[str, int, list[int], int, int]]  # (request_id, first position, targets, k, n rows)
    rows: list[int]  # flat batch rows, span after span

    def __bool__(self) -> bool:
        return bool(self.rows)


def prompt_rows(scheduled, requests) -> PromptRows:
    """The rows of ``scheduled`` (the step's entries, worker/step.py, in batch order) whose logits predict a
    prompt token of a request with ``prompt_logprobs`` (``requests``: the rank's, by req_id): the row of
    position p predicts token p + 1, for every p in the chunk with p + 1 inside the prompt."""
    spans, rows, offset = [], [], 0
    for s in scheduled:
        req = requests.get(s.req_id)
        start, n = s.start, s.num_query_tokens
        k = None if req is None else req.prompt_logprobs
        if k is not None:
            prompt = req.prompt_token_ids
            end = min(start + n, len(prompt) - 1)  # the last prompt position predicts an output token
            if start < end:
                rows.extend(range(offset, offset + end - start))
                spans.append((req.request_id, start + 1, prompt[start + 1:end + 1], k, end - start))
        offset += n
    return PromptRows(spans, rows)


def merge_rows(sample_idx: list[int], prompt: PromptRows) -> tuple[list[int], list[int], list[int]]:
    """One set of logits rows for both uses: (every row, sorted; where each sample row is in it; where each
    prompt row is in it)."""
    union = sorted(set(sample_idx) | set(prompt.rows))
    where = {r: i for i, r in enumerate(union)}
    return union, [where[r] for r in sample_idx], [where[r] for r in prompt.rows]


def compute_chunks(logits: torch.Tensor, prompt: PromptRows) -> list[PromptLogprobChunk]:
    """logits [R, V] f32, one row per prompt row (in ``prompt.rows`` order) -> one chunk per request."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor([t for span in prompt.spans for t in span[2]], dtype=torch.long).to(lp.device)
    chosen = lp.gather(1, targets[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    k = max(span[3] for span in prompt.spans)
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (None, None)
    chunks, at = [], 0
    for rid, first, tgt, want, n in prompt.spans:
        cut = slice(at, at + n)
        chunks.append(PromptLogprobChunk(rid, first, tgt, want, chosen[cut], ranks[cut],
                                         None if top_ids is None else top_ids[cut],
                                         None if top_lp is None else top_lp[cut]))
        at += n
    return chunks
