"""POST /v1/completions."""

from __future__ import annotations

import dataclasses
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from turnout.entrypoints.openai import protocol as P
from turnout.entrypoints.openai.errors import bad_request, from_value_error
from turnout.entrypoints.openai.serving import (
    MAX_CHOICES_PER_REQUEST,
    MAX_PROMPTS_PER_REQUEST,
    SSE_HEADERS,
    Prompt,
    _common_checks,
    _Delta,
    _fit_context,
    _holdback,
    _new_id,
    _now,
    _sampling_params,
    _usage,
    parse,
    sse,
)
from turnout.entrypoints.openai.serving_exchange import _admit, _engine_error, _Exchange
from turnout.entrypoints.openai.serving_grammar import _structured_outputs
from turnout.entrypoints.openai.serving_logprobs import _ranked, _sampled_logprob, _token_text, completion_logprobs

logger = logging.getLogger(__name__)


async def _prompts(state, req: P.CompletionRequest) -> list[Prompt]:
    p = req.prompt
    if isinstance(p, str):
        raw = [p]
    elif p and all(isinstance(x, int) for x in p):
        raw = [p]
    else:
        raw = list(p)
    if not raw:
        raise bad_request("prompt: must not be empty", param="prompt", code="empty_prompt")
    if len(raw) > MAX_PROMPTS_PER_REQUEST:
        raise bad_request(f"prompt: at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(raw)}",
                          param="prompt")
    prompts = []
    for r in raw:
        if isinstance(r, str):
            if not r:
                raise bad_request("prompt: must not be empty", param="prompt", code="empty_prompt")
            ids = await state.tokenize(r)
            if not ids:
                raise bad_request("prompt: tokenizes to nothing", param="prompt", code="empty_prompt")
            prompts.append(Prompt(ids, r))
        else:
            if not r:
                raise bad_request("prompt: a token-id prompt must not be empty", param="prompt", code="empty_prompt")
            # checked here, before echo detokenises them (a negative id overflows the tokenizer); the
            # engine checks again at admission
            vocab = state.vocab_size
            bad = next((t for t in r if not 0 <= t < vocab), None) if vocab else None
            if bad is not None:
                raise bad_request(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", param="prompt",
                                  code="invalid_value")
            prompts.append(Prompt(list(r)))
    return prompts


async def create_completion(state, request: Request):
    req = parse(P.CompletionRequest, await request.body())
    model_name = state.check_model(req.model)
    _common_checks(req, state)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of different from n is not supported", param="best_of", code="unsupported")
    state.require_ready()
    if req.echo and state.tokenizer is None:
        raise bad_request("echo: this model has no tokenizer to write the prompt's text", param="echo",
                          code="unsupported")
    # vLLM's echo without generation (max_tokens 0, what log-likelihood scorers such as lm-eval may send): the
    # engine samples one token, which the answer leaves out
    echo_only = bool(req.echo) and req.max_tokens == 0
    params = _sampling_params(req, max_tokens=1 if echo_only else req.max_tokens, logprobs=req.logprobs, rename={},
                              structured_outputs=await _structured_outputs(state, request, req))
    # echo with logprobs: the prompt tokens' logprobs come first in the choice's logprobs, so the engine computes
    # them (top-k of the same k) whether or not prompt_logprobs was asked for too
    # (req.logprobs was checked by SamplingParams above)
    prompt_k = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_k = req.logprobs if not isinstance(prompt_k, int) else max(prompt_k, req.logprobs)
    if prompt_k is not None:
        try:  # SamplingParams checks it (an integer in [0, MAX_LOGPROBS]) and names it
            params = dataclasses.replace(params, prompt_logprobs=prompt_k)
        except ValueError as e:
            raise from_value_error(e) from None
    prompts = await _prompts(state, req)
    if len(prompts) * params.n > MAX_CHOICES_PER_REQUEST:
        raise bad_request(f"n: {len(prompts)} prompts x n={params.n} exceeds {MAX_CHOICES_PER_REQUEST} choices",
                          param="n")
    per_prompt = [_fit_context(params, len(p.ids), state.max_model_len, "max_tokens", "prompt") for p in prompts]
    base = _new_id("cmpl")
    for p in prompts:
        if req.echo and p.text is None:
            p.text = await state.detokenize(p.ids)
    streams = await _admit(state, [(f"{base}-{i}", p.ids, sp) for i, (p, sp) in enumerate(zip(prompts, per_prompt))])
    ex = _Exchange(state, request, streams)
    if req.stream:
        return StreamingResponse(_stream(state, req, ex, prompts, params, base, model_name, echo_only),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": base})
    finals = await ex.final_outputs()
    n, k = params.n, req.logprobs
    choices, completion_tokens = [], 0
    for i, out in enumerate(finals):
        for o in out.outputs:
            ids = [] if echo_only else o.token_ids
            completion_tokens += len(ids)
            lp = None
            if k is not None:
                lp, offset = echo_logprobs(state, out, k) if req.echo else (None, 0)
                lp = _joined(lp, completion_logprobs(state, ids, o.logprobs, 0, k, offset)[0])
            text = prompts[i].text + ("" if echo_only else o.text) if req.echo else o.text
            choices.append(P.CompletionChoice(index=i * n + o.index, text=text, logprobs=lp,
                                              finish_reason="length" if echo_only else o.finish_reason,
                                              stop_reason=None if echo_only else o.stop_reason,
                                              **_token_fields(req, out, ids, first=True)))
    resp = P.CompletionResponse(id=base, model=model_name, choices=choices,
                                usage=_usage(sum(len(p.ids) for p in prompts), completion_tokens))
    return JSONResponse(resp.model_dump(), headers={"X-Request-Id": base})


async def _stream(state, req, ex: _Exchange, prompts, params, base, model_name, echo_only: bool):
    n, k = params.n, req.logprobs
    created = _now()
    deltas = {}
    offsets = {}
    completion_tokens = {}
    started = set()  # choices whose first chunk went out (it carries the prompt's fields)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        async for i, out in ex.merged():
            choices = []
            for o in out.outputs:
                ci = i * n + o.index
                d = deltas.get(ci)
                if d is None:
                    d = deltas[ci] = _Delta(_holdback(params), prompts[i].text if req.echo else "")
                    offsets[ci] = 0
                if d.done:
                    continue
                first_chunk = ci not in started
                if req.echo and k is not None and first_chunk and not o.token_ids and o.finish_reason is None:
                    continue  # the prompt's logprobs are whole once its first token is sampled
                lp = None
                if echo_only:  # one chunk: the prompt, its logprobs, "length"
                    d.done, text, ids = True, prompts[i].text, []
                    lp = echo_logprobs(state, out, k)[0] if k is not None else None
                    o = dataclasses.replace(o, finish_reason="length", stop_reason=None)
                else:
                    text, ids, first = d.step(o)
                    completion_tokens[ci] = len(o.token_ids)
                    if k is not None and req.echo and first_chunk:  # the prompt's logprobs lead the first chunk
                        lp, offsets[ci] = echo_logprobs(state, out, k)
                    if k is not None and ids:
                        more, offsets[ci] = completion_logprobs(state, ids, o.logprobs, first, k, offsets[ci])
                        lp = _joined(lp, more)
                if not text and lp is None and not d.done and not (req.return_token_ids and ids):
                    continue
                started.add(ci)
                choices.append(P.CompletionChoice(index=ci, text=text, logprobs=lp,
                                                  finish_reason=o.finish_reason if d.done else None,
                                                  stop_reason=o.stop_reason if d.done else None,
                                                  **_token_fields(req, out, ids, first=first_chunk)))
            if choices:
                yield sse(P.CompletionStreamChunk(id=base, created=created, model=model_name,
                                                  choices=choices).model_dump())
        if ex.disconnected:
            return
        if include_usage:
            usage = _usage(sum(len(p.ids) for p in prompts), sum(completion_tokens.values()))
            yield sse(P.CompletionStreamChunk(id=base, created=created, model=model_name, choices=[],
                                              usage=usage).model_dump())
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, never hang
        yield sse(_engine_error(e).body())
        yield "data: [DONE]\n\n"
    finally:
        ex.close()


def echo_logprobs(state, out, k: int) -> tuple[P.CompletionLogProbs, int]:
    """The prompt's part of an echoed choice's logprobs, as vLLM writes it: every prompt token with its
    logprob (None at position 0, which nothing predicts) and its top-k; and the text offset after it."""
    lp, offset = P.CompletionLogProbs(), 0
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for tid, entry in zip(out.prompt_token_ids, entries):
        tok = _token_text(state, tid, entry)
        lp.tokens.append(tok)
        lp.token_logprobs.append(_sampled_logprob(entry, tid))
        lp.top_logprobs.append({_token_text(state, i, entry): max(v, -9999.0) for i, v in _ranked(entry, k)}
                               if entry is not None and k else None)
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp, offset


def _joined(head: P.CompletionLogProbs | None, tail: P.CompletionLogProbs) -> P.CompletionLogProbs:
    if head is None:
        return tail
    return P.CompletionLogProbs(text_offset=head.text_offset + tail.text_offset,
                                token_logprobs=head.token_logprobs + tail.token_logprobs,
                                tokens=head.tokens + tail.tokens, top_logprobs=head.top_logprobs + tail.top_logprobs)


def _token_fields(req: P.CompletionRequest, out, ids: list[int], first: bool) -> dict:
    """vLLM's token-level extras of one choice: ``token_ids`` (with ``return_token_ids``; in a stream the
    chunk's new ids), and in the first chunk only ``prompt_token_ids`` and ``prompt_logprobs``."""
    fields = {}
    if req.return_token_ids:
        fields["token_ids"] = list(ids)
        if first:
            fields["prompt_token_ids"] = list(out.prompt_token_ids)
    if req.prompt_logprobs is not None and first:
        fields["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    return fields


def prompt_logprobs_json(entries: list | None) -> list | None:
    """The engine's prompt logprobs as vLLM's server writes them: None at position 0, then per position
    {token id: {logprob, rank, decoded_token}}: the prompt token (whatever its rank) and the top-k the
    engine computed.
    -inf is written as -9999.0, as the other logprobs (JSON has no infinity)."""
    if entries is None:
        return None
    rows = []
    for entry in entries:
        if entry is None:
            rows.append(None)
            continue
        rows.append({tid: P.PromptLogprob(logprob=max(float(lp.logprob), -9999.0), rank=lp.rank,
                                          decoded_token=lp.decoded_token) for tid, lp in entry.items()})
    return rows
