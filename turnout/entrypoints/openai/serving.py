"""/v1/completions and /v1/chat/completions: parse, validate, tokenize, admit, then answer or stream.
This module holds what both routes share before and after the engine: parsing and validation, and the
stream deltas. Admission and the wait on the engine are in serving_exchange.py, logprobs in
serving_logprobs.py.

Everything a client can get wrong is checked before the request reaches the engine, and every check
raises an APIError that names the field. Streams compute deltas from the engine's cumulative outputs,
holding back text that may still turn out to be part of a stop string, so that a streamed answer
equals the non-streamed one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid

import pydantic

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
            skip_special_tokens=opt(req.skip_special_tokens, True), structured_outputs=structured_outputs,
            speculative_decoding=opt(req.speculative_decoding, True))
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
