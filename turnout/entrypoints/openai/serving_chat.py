"""POST /v1/chat/completions (tool calls and reasoning: chat_tools.py)."""

from __future__ import annotations

import dataclasses
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from turnout.entrypoints.openai import protocol as P
from turnout.entrypoints.openai.chat_tools import (
    ChoiceParser,
    keeps_special_tokens,
    plan_tools,
    reasoning_parser,
    template_messages,
)
from turnout.entrypoints.openai.errors import bad_request
from turnout.entrypoints.openai.serving import (
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
from turnout.entrypoints.openai.serving_grammar import _structured_outputs, off_loop
from turnout.entrypoints.openai.serving_logprobs import chat_logprobs

logger = logging.getLogger(__name__)


def _messages(messages: list[P.ChatMessage] | None) -> list[dict]:
    """The conversation as the chat template takes it (content parts joined, tool-call arguments as
    objects); shared with /tokenize."""
    if not messages:
        raise bad_request("messages: must contain at least one message", param="messages", code="empty_messages")
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "\n".join(part.text for part in m.content)
        elif m.content is None:
            d["content"] = ""
        out.append(d)
    return template_messages(out)


# apply_chat_template's own parameters: chat_template_kwargs carries only the template's variables
# (enable_thinking, ...), never what the server decides (the template, tokenising, the tools).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs"})


def _template_kwargs(req, tools) -> dict:
    kw = dict(req.chat_template_kwargs or {})
    bad = sorted(set(kw) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise bad_request(f"chat_template_kwargs.{bad[0]}: not a template variable (the server sets it)",
                          param=f"chat_template_kwargs.{bad[0]}", code="invalid_value")
    if tools:
        kw["tools"] = tools
    return kw


def _checks(state, req: P.ChatCompletionRequest) -> None:
    _common_checks(req, state)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", param="top_logprobs")


async def create_chat_completion(state, request: Request):
    req = parse(P.ChatCompletionRequest, await request.body())
    model_name = state.check_model(req.model)
    _checks(state, req)
    messages = _messages(req.messages)
    plan = (await off_loop(state, request, req, lambda: plan_tools(req, state.options), lambda: "tools")
            if req.tools or req.tool_choice is not None else plan_tools(req, state.options))
    state.require_ready()
    max_tokens, mt_name = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        max_tokens, mt_name = req.max_completion_tokens, "max_completion_tokens"
    k = (req.top_logprobs or 0) if req.logprobs else None
    so = await _structured_outputs(state, request, req, plan.constraint)
    params = _sampling_params(req, max_tokens=max_tokens, logprobs=k,
                              rename={"max_tokens": mt_name, "logprobs": "top_logprobs"}, structured_outputs=so)
    if keeps_special_tokens(state.options, plan, so is not None) and "skip_special_tokens" not in req.model_fields_set:
        params = dataclasses.replace(params, skip_special_tokens=False)
    ids = await state.chat_template(messages, add_generation_prompt=req.add_generation_prompt is not False,
                                    **_template_kwargs(req, plan.template_tools))
    params = _fit_context(params, len(ids), state.max_model_len, mt_name, "messages")
    tail = await state.detokenize(ids[-8:]) if state.options.reasoning_parser else ""
    rp = reasoning_parser(state.options, tail, plan, structured=so is not None)
    base = _new_id("chatcmpl")
    streams = await _admit(state, [(base, ids, params)])
    ex = _Exchange(state, request, streams)
    if req.stream:
        return StreamingResponse(_stream(state, req, ex, Prompt(ids), params, base, model_name,
                                         lambda: ChoiceParser(rp, plan)),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": base})
    (out,) = await ex.final_outputs()
    choices = []
    for o in out.outputs:
        msg, finish_reason = ChoiceParser(rp, plan).complete(o.text, o.finish_reason)
        choices.append(P.ChatCompletionChoice(
            index=o.index, message=P.ChatResponseMessage(**msg),
            logprobs=chat_logprobs(state, o.token_ids, o.logprobs, 0, k) if k is not None else None,
            finish_reason=finish_reason, stop_reason=o.stop_reason))
    resp = P.ChatCompletionResponse(id=base, model=model_name, choices=choices,
                                    usage=_usage(len(ids), sum(len(o.token_ids) for o in out.outputs)))
    return JSONResponse(resp.model_dump(), headers={"X-Request-Id": base})


def _chunk(base, created, model_name, choices, usage=None) -> dict:
    d = P.ChatCompletionChunk(id=base, created=created, model=model_name, choices=choices, usage=usage).model_dump()
    for c in d["choices"]:
        c["delta"] = {key: v for key, v in c["delta"].items() if v is not None}
    return d


async def _stream(state, req, ex: _Exchange, prompt: Prompt, params, base, model_name, new_parser):
    k = params.logprobs
    created = _now()
    deltas = {i: _Delta(_holdback(params)) for i in range(params.n)}
    parsers = {i: new_parser() for i in range(params.n)}
    completion_tokens = {}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        yield sse(_chunk(base, created, model_name, [
            P.ChatCompletionStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
            for i in range(params.n)]))
        async for _, out in ex.merged():
            choices = []
            for o in out.outputs:
                d = deltas.setdefault(o.index, _Delta(_holdback(params)))
                if d.done:
                    continue
                text, ids, first = d.step(o)
                completion_tokens[o.index] = len(o.token_ids)
                lp = chat_logprobs(state, ids, o.logprobs, first, k) if k is not None and ids else None
                parser = parsers.setdefault(o.index, new_parser())
                if d.done:
                    fields, finish_reason = parser.finish(text, o.finish_reason)
                else:
                    fields, finish_reason = parser.feed(text), None
                if not fields and lp is None and not d.done:
                    continue
                choices.append(P.ChatCompletionStreamChoice(
                    index=o.index, delta=P.DeltaMessage(**fields), logprobs=lp, finish_reason=finish_reason,
                    stop_reason=o.stop_reason if d.done else None))
            if choices:
                yield sse(_chunk(base, created, model_name, choices))
        if ex.disconnected:
            return
        if include_usage:
            yield sse(_chunk(base, created, model_name, [],
                             usage=_usage(len(prompt.ids), sum(completion_tokens.values()))))
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, never hang
        yield sse(_engine_error(e).body())
        yield "data: [DONE]\n\n"
    finally:
        ex.close()
