"""/v1/completions and /v1/chat/completions: parse, validate, tokenize, admit, then answer or stream.

Everything a client can get wrong is checked before the request reaches the engine, and every check
raises an APIError that names the field. Streams compute deltas from the engine's cumulative outputs,
holding back text that may still turn out to be part of a stop string, so that a streamed answer
equals the non-streamed one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid

import pydantic
from fastapi import Request

from turnout.engine.async_engine import EngineDeadError, EngineDraining, EngineUnavailable, QueueFull, RequestStream
from turnout.engine.sampling_params import SamplingParams
from turnout.entrypoints.openai import protocol as P
from turnout.entrypoints.openai.errors import APIError, bad_request, from_validation_error, from_value_error

logger = logging.getLogger(__name__)

MAX_PROMPTS_PER_REQUEST = 64
MAX_CHOICES_PER_REQUEST = 128
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_warned_fields: set[str] = set()


def parse(model: type[pydantic.BaseModel], body: bytes):
    try:
        req = model.model_validate_json(body)
    except pydantic.ValidationError as e:
        raise from_validation_error(e) from None
    _warn_unknown(req)
    return req


def _warn_unknown(req: pydantic.BaseModel) -> None:
    """Fields the server does not know are ignored, as vLLM does, but never silently: one warning per
    field name per process (a client sending it on every request logs it once). Message fields pass
    through to the chat template and are not unknown."""
    extra = dict(req.model_extra or {})
    so = getattr(req, "stream_options", None)
    if isinstance(so, pydantic.BaseModel):
        extra.update({f"stream_options.{k}": v for k, v in (so.model_extra or {}).items()})
    for name in extra:
        if name not in _warned_fields and len(_warned_fields) < 1000:  # a bound: names are the client's
            _warned_fields.add(name)
            logger.warning("%s: the request field %r is not known to this server and is ignored (warned once)",
                           type(req).__name__, name[:100])


@dataclasses.dataclass
class Prompt:
    ids: list[int]
    text: str | None = None  # for echo


def _sampling_params(req, *, max_tokens, logprobs, rename, structured_outputs=None) -> SamplingParams:
    def opt(v, default):
        return default if v is None else v

    try:
        return SamplingParams(
            n=opt(req.n, 1), temperature=opt(req.temperature, 1.0), top_p=opt(req.top_p, 1.0),
            top_k=opt(req.top_k, 0), min_p=opt(req.min_p, 0.0), seed=req.seed,
            presence_penalty=opt(req.presence_penalty, 0.0), frequency_penalty=opt(req.frequency_penalty, 0.0),
            repetition_penalty=opt(req.repetition_penalty, 1.0), stop=req.stop, stop_token_ids=req.stop_token_ids,
            max_tokens=max_tokens, min_tokens=opt(req.min_tokens, 0), ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs, include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=opt(req.skip_special_tokens, True), structured_outputs=structured_outputs)
    except ValueError as e:
        raise from_value_error(e, rename) from None


def _fit_context(params: SamplingParams, prompt_len: int, max_model_len: int, max_tokens_name: str,
                 prompt_name: str) -> SamplingParams:
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                       f"{prompt_len} tokens, which leaves no room for the completion. Please shorten the prompt.",
                       param=prompt_name, code="context_length_exceeded")
    if params.max_tokens is None:
        return dataclasses.replace(params, max_tokens=max_model_len - prompt_len)
    if prompt_len + params.max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                       f"requested {prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                       f"{params.max_tokens} for the completion). Please reduce the prompt or {max_tokens_name}.",
                       param=max_tokens_name, code="context_length_exceeded")
    return params


def _common_checks(req, state=None) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias", code="unsupported")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if state is not None:
        check_max_logprobs(req, state.options.max_logprobs)


def check_max_logprobs(req, max_logprobs: int) -> None:
    """``--max-logprobs``: any logprob count (``logprobs`` on completions, ``top_logprobs`` on chat,
    ``prompt_logprobs``) above it is a 400 naming the field."""
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        v = getattr(req, name, None)
        if type(v) is int and v > max_logprobs:
            raise bad_request(f"{name}: at most {max_logprobs} (--max-logprobs), got {v}", param=name,
                              code="invalid_value")


async def _admit(state, items) -> list[RequestStream]:
    try:
        return await state.async_engine.add_requests(items)
    except QueueFull as e:
        state.metrics.rejected.labels(reason="queue_full").inc()
        raise APIError(503, f"The server is overloaded: {e}", type="server_overloaded", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except EngineDraining:
        state.metrics.rejected.labels(reason="draining").inc()
        raise APIError(503, "The server is shutting down.", type="service_unavailable", code="shutting_down",
                       headers={"Retry-After": "5", "Connection": "close"}) from None
    except EngineDeadError as e:
        raise APIError(503, f"The engine is not available: {e}", type="service_unavailable",
                       code="engine_dead") from None
    except EngineUnavailable as e:  # asleep or paused (the RL endpoints)
        raise APIError(503, str(e), type="service_unavailable", code="engine_unavailable",
                       headers={"Retry-After": "1"}) from None
    except ValueError as e:
        if getattr(e, "prompt_len", None) is not None:  # the engine's ContextLengthError
            raise APIError(400, f"This model's maximum context length is {e.max_model_len} tokens, but the "
                           f"prompt has {e.prompt_len} tokens.", param="prompt",
                           code="context_length_exceeded") from None
        raise from_value_error(e) from None


def _request_failed(out) -> APIError | None:
    """A fault the engine traced to this request (RequestOutput.error): it failed alone, the engine lives.
    Not the client's mistake as far as the server can tell (validation let it through): a 500 naming it."""
    err = getattr(out, "error", None)
    if err is None:
        return None
    logger.error("request %s failed inside the engine: %s", out.request_id, err)
    return APIError(500, f"The request failed inside the engine: {err}", type="internal_server_error",
                    code="request_failed")


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDraining):
        return APIError(503, str(e), type="service_unavailable", code="shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(500, str(e), type="internal_server_error", code="engine_dead")
    logger.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}", type="internal_server_error", code="internal_error")


async def _watch_disconnect(request: Request, on_disconnect) -> None:
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a broken transport is a disconnect too
        pass
    on_disconnect()


class _Exchange:
    """One HTTP request's engine requests: watches the client and aborts them all if it goes away."""

    def __init__(self, state, request: Request, streams: list[RequestStream]):
        self.state, self.streams = state, streams
        self.disconnected = False
        self._watcher = asyncio.ensure_future(_watch_disconnect(request, self._on_disconnect))

    def _on_disconnect(self) -> None:
        self.disconnected = True
        self.close()

    def close(self) -> None:
        self._watcher.cancel()
        for s in self.streams:
            self.state.async_engine.abort(s.request_id)

    async def final_outputs(self):
        async def last(s):
            out = None
            async for out in s:  # noqa: B007 - the stream's last output is the answer
                pass
            return out

        try:
            results = await asyncio.gather(*(last(s) for s in self.streams), return_exceptions=True)
        finally:
            self.close()
        if self.disconnected:
            raise APIError(499, "client disconnected")
        for r in results:
            if isinstance(r, BaseException):
                raise _engine_error(r)
            failed = _request_failed(r)
            if failed is not None:
                raise failed
        return results

    async def merged(self):
        """(prompt index, cumulative output) as they arrive, over all streams."""
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                if (failed := _request_failed(out)) is not None:
                    raise failed
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, s):
            try:
                async for out in s:
                    q.put_nowait((i, out, None))
                q.put_nowait((i, None, None))
            except BaseException as e:  # noqa: BLE001
                q.put_nowait((i, None, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            left = len(tasks)
            while left:
                i, out, err = await q.get()
                if err is not None:
                    raise err
                if out is None:
                    left -= 1
                elif (failed := _request_failed(out)) is not None:
                    raise failed
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()


class _Delta:
    """Per-choice streaming state: what was sent so far, text held back for a possible stop string."""

    def __init__(self, holdback: int, prefix: str = ""):
        self.holdback, self.prefix = holdback, prefix
        self.text_sent = ""
        self.tokens_sent = 0
        self.done = False

    def step(self, o) -> tuple[str, list[int], int]:
        """(new text, new token ids, index of the first new token)."""
        finished = o.finish_reason is not None
        visible = o.text
        if not finished:
            visible = visible[:max(len(self.text_sent), len(visible) - self.holdback)] if self.holdback else visible
            visible = visible.rstrip("\ufffd") if visible.endswith("\ufffd") else visible  # half a UTF-8 char
        new_text = ""
        if len(visible) > len(self.text_sent) and visible.startswith(self.text_sent):
            new_text = visible[len(self.text_sent):]
            self.text_sent = visible
        elif finished and not visible.startswith(self.text_sent):
            logger.debug("final text diverged from the streamed text")
        first = self.tokens_sent
        new_ids = list(o.token_ids[first:])
        self.tokens_sent = len(o.token_ids)
        self.done = finished
        if self.prefix:
            new_text, self.prefix = self.prefix + new_text, ""
        return new_text, new_ids, first


def _holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop_strings), default=1) - 1


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> P.UsageInfo:
    return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------- logprobs
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
