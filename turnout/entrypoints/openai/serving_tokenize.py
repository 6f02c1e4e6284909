"""POST /tokenize and POST /detokenize (vLLM's extras): the server's own tokenizer and chat template, so a
client counts tokens exactly as the server will (prompt budgets, context checks) without loading either.

/tokenize takes a ``prompt`` (encoded with the tokenizer's special tokens unless ``add_special_tokens`` is
false) or chat ``messages`` (rendered as /v1/chat/completions renders them: the same template, ``tools``
and ``chat_template_kwargs``), and answers ``{tokens, count, max_model_len}`` (``token_strs`` on
request). /detokenize takes ``tokens`` and answers ``{prompt}``. Both live beside /v1, as in vLLM, and
are outside the API key, as in vLLM (it guards /v1/* only).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from turnout.entrypoints.openai import protocol as P
from turnout.entrypoints.openai.errors import bad_request
from turnout.entrypoints.openai.serving import parse

MAX_TOKENIZE_TOKENS = 1 << 20  # /detokenize input; the body limit (--max-request-bytes) bounds it first


async def tokenize(state, request: Request):
    from turnout.entrypoints.openai.chat_tools import checked_tools
    from turnout.entrypoints.openai.serving_chat import _messages, _template_kwargs
    from turnout.entrypoints.openai.serving_grammar import off_loop

    req = parse(P.TokenizeRequest, await request.body())
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt: give exactly one of prompt and messages", param="prompt", code="invalid_value")
    state.require_ready()
    if req.prompt is not None:
        add = req.add_special_tokens is not False
        ids = list(await state._tok(state.tokenizer.encode, req.prompt, add_special_tokens=add))
    else:
        messages = _messages(req.messages)
        tools = None
        if req.tools:  # each tool's schema is built to check it: off the event loop
            tools = await off_loop(state, request, req, lambda: checked_tools(req.tools), lambda: "tools")
        ids = await state.chat_template(messages, add_generation_prompt=req.add_generation_prompt is not False,
                                        **_template_kwargs(req, tools))
    strs = [state.decode_token(t) for t in ids] if req.return_token_strs else None
    return JSONResponse(P.TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                                           token_strs=strs).model_dump(exclude_none=True))


async def detokenize(state, request: Request):
    req = parse(P.DetokenizeRequest, await request.body())
    state.check_model(req.model)
    state.require_ready()
    vocab = state.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None) if vocab else None
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens",
                          code="invalid_value")
    if len(req.tokens) > MAX_TOKENIZE_TOKENS:
        raise bad_request(f"tokens: at most {MAX_TOKENIZE_TOKENS} tokens", param="tokens")
    return JSONResponse(P.DetokenizeResponse(prompt=await state.detokenize(req.tokens)).model_dump())


def add_tokenize_routes(app, state) -> None:
    @app.post("/tokenize")
    async def _tokenize(request: Request):
        return await tokenize(state, request)

    @app.post("/detokenize")
    async def _detokenize(request: Request):
        return await detokenize(state, request)
