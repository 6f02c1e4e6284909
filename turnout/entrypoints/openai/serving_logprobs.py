"""The logprobs of an answer in the OpenAI shapes: chat's ``logprobs.content`` and completions'
``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``. Apart from serving.py because it is the
one place that turns the engine's per-position Logprob maps into token texts and ranked lists.
"""

from __future__ import annotations

from turnout.entrypoints.openai import protocol as P


def _ranked(entry: dict, k: int) -> list[tuple[int, float]]:
    """The top-k (token id, logprob) of one position, best first."""
    items = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
    return [(tid, lp.logprob) for tid, lp in items[:k]]


def _token_text(state, tid: int, entry: dict | None) -> str:
    lp = entry.get(tid) if entry else None
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    if state.tokenizer is None:  # a model without a tokenizer: vLLM's name for a token without text
        return f"token_id:{tid}"
    return state.decode_token(tid)


def _sampled_logprob(entry: dict | None, tid: int) -> float | None:
    lp = entry.get(tid) if entry else None
    return None if lp is None else max(float(lp.logprob), -9999.0)


def chat_logprobs(state, ids: list[int], entries: list | None, first: int, k: int) -> P.ChatChoiceLogprobs:
    content = []
    for j, tid in enumerate(ids):
        entry = entries[first + j] if entries is not None and first + j < len(entries) else None
        tok = _token_text(state, tid, entry)
        tops = [P.TopLogprob(token=(t := _token_text(state, i, entry)), logprob=max(lp, -9999.0),
                             bytes=list(t.encode("utf-8"))) for i, lp in _ranked(entry or {}, k)]
        lp = _sampled_logprob(entry, tid)  # 0.0 (a certain token) is a logprob, not a missing one
        content.append(P.ChatTokenLogprob(token=tok, logprob=-9999.0 if lp is None else lp,
                                          bytes=list(tok.encode("utf-8")), top_logprobs=tops))
    return P.ChatChoiceLogprobs(content=content)


def completion_logprobs(state, ids: list[int], entries: list | None, first: int, k: int,
                        offset: int) -> tuple[P.CompletionLogProbs, int]:
    out = P.CompletionLogProbs()
    for j, tid in enumerate(ids):
        entry = entries[first + j] if entries is not None and first + j < len(entries) else None
        tok = _token_text(state, tid, entry)
        out.tokens.append(tok)
        out.token_logprobs.append(_sampled_logprob(entry, tid))
        out.top_logprobs.append({_token_text(state, i, entry): max(lp, -9999.0)
                                 for i, lp in _ranked(entry or {}, k)} if k else None)
        out.text_offset.append(offset)
        offset += len(tok)
    return out, offset
