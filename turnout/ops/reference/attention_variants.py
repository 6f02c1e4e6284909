"""What the attention variants mean, once, for every implementation of the attention ops.

Every attention op (``paged_attention``, ``rotary_paged_attention``, the batch-invariant ones) takes them as
keyword-only arguments; their defaults (None) are plain causal attention:

* ``sliding_window`` W: a query at absolute position p attends only keys at positions j with p - W < j <= p
  (W keys, itself included): Hugging Face's convention (``kv_idx > q_idx - sliding_window``). Keys before the
  window may sit in blocks that were freed and reused, so an implementation never reads them, not even
  multiplied by zero (a NaN there would poison the sum).
* ``logit_softcap`` c: scores = c * tanh(scores / c), after the scale, before the mask and softmax (Gemma 2).
* ``sinks`` [Hq] float32: a learned logit per query head (GPT-OSS) that joins every row's softmax denominator
  as exp(sink - max) and contributes no value, so a head can attend to "nothing".
"""

from __future__ import annotations

import torch


def check_variants(sliding_window, logit_softcap, sinks, num_heads: int) -> None:
    """ValueError naming the argument when a variant's value cannot mean anything."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if logit_softcap is not None and not float(logit_softcap) > 0.0:
        raise ValueError(f"logit_softcap must be a positive number or None, got {logit_softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_heads,):
            got = (f"{tuple(sinks.shape)} {sinks.dtype}" if isinstance(sinks, torch.Tensor)
                   else type(sinks).__name__)
            raise ValueError(f"sinks must be a float32 tensor of shape ({num_heads},) (one per query head), got {got}")


def window_start(first_query_pos: int, sliding_window: int | None) -> int:
    """The first key position any query at or after ``first_query_pos`` may read (0 without a window)."""
    return 0 if sliding_window is None else max(0, first_query_pos - sliding_window + 1)


def key_mask(qpos: torch.Tensor, kpos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[L, K] bool: query at qpos[i] may attend key at kpos[j] (causal, and within the window)."""
    ok = kpos[None, :] <= qpos[:, None]
    if sliding_window is not None:
        ok &= kpos[None, :] > qpos[:, None] - sliding_window
    return ok


def softcap(scores: torch.Tensor, logit_softcap: float | None) -> torch.Tensor:
    return scores if logit_softcap is None else logit_softcap * torch.tanh(scores / logit_softcap)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor, scale: float,
           sliding_window: int | None = None, logit_softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Dense attention in float32: q [L, H, D], k / v [K, H, D] (heads already repeated for GQA), qpos [L],
    kpos [K] absolute positions -> [L, H, D]. Every query row must have at least one key it may attend."""
    scores = softcap(torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale, logit_softcap)
    scores = scores.masked_fill(~key_mask(qpos, kpos, sliding_window)[None], float("-inf"))
    if sinks is not None:  # one more logit per row, whose value is zero: it only grows the denominator
        sink_col = sinks.float().to(scores.device)[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink_col], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float())
