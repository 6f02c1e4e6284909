"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, each naming the bad field."""

from __future__ import annotations

import re

import pydantic
from fastapi.responses import JSONResponse

_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}},
                        status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _param_of(loc: tuple) -> str | None:
    # Drop pydantic's union-member tags ("list[int]", "TextContentPart") from the location.
    parts = [str(p) for p in loc if isinstance(p, int) or (isinstance(p, str) and _FIELD.match(p)
                                                          and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


def from_validation_error(e: pydantic.ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}",
                           code="invalid_json")
    param = _param_of(first["loc"])
    if param is None and first["type"] == "model_type":
        return bad_request("the request body must be a JSON object", code="invalid_request_body")
    # One field may fail several union members: say what each expected, once.
    msgs = []
    for err in errors:
        if _param_of(err["loc"]) == param or (param and (_param_of(err["loc"]) or "").startswith(param)):
            m = "field required" if err["type"] == "missing" else err["msg"]
            if m not in msgs:
                msgs.append(m)
    return bad_request(f"{param or 'body'}: {'; or '.join(msgs[:4])}", param=param,
                       code="missing_field" if first["type"] == "missing" else "invalid_type")


def from_value_error(e: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """SamplingParams / engine ValueErrors read ``"field: why"``; keep the field (renamed to the API's name)."""
    text = str(e)
    field, sep, why = text.partition(":")
    if sep and _FIELD.match(field.strip()):
        field = field.strip()
        api_field = (rename or {}).get(field, field)
        return bad_request(f"{api_field}:{why}", param=api_field, code="invalid_value")
    return bad_request(text, code="invalid_value")
