"""POST /tokenize and POST /detokenize (vLLM's extras): the server's own tokenizer and chat template, so a
client counts tokens exactly as the server will (prompt budgets, context checks) without loading either.

/tokenize takes a ``prompt`` (encoded with the tokenizer's special tokens unless ``add_special_tokens`` is
false) or chat ``messages`` (rendered as /v1/chat/completions renders them: the same template, ``tools``
and ``chat_template_kwargs``), and answers ``{tokens, count, max_model_len}`` (``token_strs`` on
request). /detokenize takes ``tokens`` and answers ``{prompt}``.

Both live beside /v1, as in vLLM, but behind the API key like /v1 (http_guard.KEYED_PATHS): a chat
template and a tool list cost seconds to render and check, which no keyless caller may spend. They run on a
thread of their own (``TokenizeLane``), never on the event loop and never on the tokenizer thread the
generation routes share, with at most ``MAX_TOKENIZE_IN_FLIGHT`` admitted at once (more: 429), so a flood
of large /tokenize bodies delays only /tokenize.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse

from turnout.entrypoints.openai import protocol as P
from turnout.entrypoints.openai.errors import APIError, bad_request
from turnout.entrypoints.openai.serving import parse

MAX_TOKENIZE_TOKENS = 1 << 20  # /detokenize input; the body limit (--max-request-bytes) bounds it first
MAX_TOKENIZE_IN_FLIGHT = 4  # /tokenize + /detokenize requests running or queued on their thread


class TokenizeLane:
    """The one thread /tokenize and /detokenize run on, and the count of requests admitted to it."""

    def __init__(self, max_in_flight: int = MAX_TOKENIZE_IN_FLIGHT):
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # touched on the event loop only
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="turnout-tokenize")

    async def run(self, fn, *args):
        if self.in_flight >= self.max_in_flight:
            raise APIError(429, f"{self.in_flight} /tokenize or /detokenize requests are in flight (at most "
                           f"{self.max_in_flight}); retry later", type="rate_limit_error", code="too_many_requests",
                           headers={"Retry-After": "1"})
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.in_flight -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _tokenize_sync(state, req: P.TokenizeRequest) -> dict:
    """All the work of /tokenize, on the lane's thread: tool checks, template, encoding, token strings."""
    from turnout.entrypoints.openai.chat_tools import checked_tools
    from turnout.entrypoints.openai.serving_chat import _messages, _template_kwargs

    if req.prompt is not None:
        ids = list(state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False))
    else:
        kwargs = _template_kwargs(req, checked_tools(req.tools))
        if state.options.chat_template is not None:  # --chat-template
            kwargs["chat_template"] = state.options.chat_template
        try:
            ids = list(state.engine.apply_chat_template(_messages(req.messages),
                                                        add_generation_prompt=req.add_generation_prompt is not False,
                                                        **kwargs))
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - a template rejecting the conversation is the client's mistake
            raise APIError(400, f"messages: {e}", param="messages", code="invalid_messages") from None
    strs = [state.tokenizer.decode([t]) for t in ids] if req.return_token_strs else None
    return P.TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                              token_strs=strs).model_dump(exclude_none=True)


async def tokenize(state, request: Request):
    req = parse(P.TokenizeRequest, await request.body())
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt: give exactly one of prompt and messages", param="prompt", code="invalid_value")
    state.require_ready()
    return JSONResponse(await state.tokenize_lane.run(_tokenize_sync, state, req))


async def detokenize(state, request: Request):
    req = parse(P.DetokenizeRequest, await request.body())
    state.check_model(req.model)
    state.require_ready()
    if len(req.tokens) > MAX_TOKENIZE_TOKENS:
        raise bad_request(f"tokens: at most {MAX_TOKENIZE_TOKENS} tokens", param="tokens")
    vocab = state.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None) if vocab else None
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens",
                          code="invalid_value")
    text = await state.tokenize_lane.run(state.tokenizer.decode, req.tokens)
    return JSONResponse(P.DetokenizeResponse(prompt=text).model_dump())


def add_tokenize_routes(app, state) -> None:
    @app.post("/tokenize")
    async def _tokenize(request: Request):
        return await tokenize(state, request)

    @app.post("/detokenize")
    async def _detokenize(request: Request):
        return await detokenize(state, request)
