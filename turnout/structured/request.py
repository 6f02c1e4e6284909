"""The request fields that ask for structured output -> one StructuredOutputsParams (or None).

Accepted, as the OpenAI API and vLLM name them:

- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``, ``{"type":
  "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` and vLLM's ``{"type":
  "structural_tag", ...}``. The schema is enforced whatever ``strict`` says (as vLLM does; OpenAI's
  non-strict mode is best effort, and enforcing is the better effort); a json_schema without ``schema``
  asks for any JSON object.
- ``structured_outputs``: a dict of StructuredOutputsParams' fields (vLLM's current API).
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``,
  ``guided_whitespace_pattern`` and top-level ``structural_tag``.

At most one source may ask; errors are StructuredOutputsError naming the request field
(``response_format.json_schema.schema``, ``guided_regex``, ``structured_outputs.choice``, ...).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from turnout.structured.params import StructuredOutputsError, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
           "structural_tag": "structural_tag"}
_OPTION_FIELDS = {f.name for f in dataclasses.fields(StructuredOutputsParams)} - {"field_names"}


def _get(obj, name):
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    value = getattr(obj, name, None)
    return value


def _as_dict(value, field: str) -> dict:
    if isinstance(value, Mapping):
        return dict(value)
    if hasattr(value, "model_dump"):  # a pydantic request model
        return value.model_dump(exclude_none=True)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    raise StructuredOutputsError(field, f"must be an object, got {type(value).__name__}")


def from_response_format(response_format) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` (a dict or a pydantic model) -> params, None for ``text``."""
    if response_format is None:
        return None
    rf = _as_dict(response_format, "response_format")
    kind = rf.get("type")
    if kind in (None, "text"):
        if kind is None:
            raise StructuredOutputsError("response_format.type", "missing (text, json_object, json_schema or "
                                                                "structural_tag)")
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, field_names={"json_object": "response_format"})
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if spec is None:
            raise StructuredOutputsError("response_format.json_schema", "missing (type json_schema needs it)")
        spec = _as_dict(spec, "response_format.json_schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise StructuredOutputsError("response_format.json_schema.strict", "must be a boolean")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise StructuredOutputsError("response_format.json_schema.name", "must be a string")
        # OpenAI's SDK sends the schema under "schema"; some clients under "schema_" (a pydantic alias).
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            return StructuredOutputsParams(json_object=True, field_names={"json_object": "response_format.json_schema"})
        return StructuredOutputsParams(json=schema, field_names={"json": "response_format.json_schema.schema"})
    if kind == "structural_tag":
        tag = {k: v for k, v in rf.items()}
        return StructuredOutputsParams(structural_tag=json.dumps(tag), field_names={"structural_tag": "response_format"})
    raise StructuredOutputsError("response_format.type", f"unknown type {kind!r} (text, json_object, json_schema "
                                                        "or structural_tag)")


def from_structured_outputs(value) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs`` request field (a dict of StructuredOutputsParams' fields)."""
    if value is None:
        return None
    if isinstance(value, StructuredOutputsParams):
        return value
    d = _as_dict(value, "structured_outputs")
    unknown = sorted(set(d) - _OPTION_FIELDS)
    if unknown:
        raise StructuredOutputsError(f"structured_outputs.{unknown[0]}", "unknown field (known: "
                                                                      f"{', '.join(sorted(_OPTION_FIELDS))})")
    names = {k: f"structured_outputs.{k}" for k in _OPTION_FIELDS}
    names["structured_outputs"] = "structured_outputs"
    return StructuredOutputsParams(**d, field_names=names)


def from_request(request: Any = None, **fields) -> StructuredOutputsParams | None:
    """The structured-output constraint of a request: an object or dict carrying any of ``response_format``,
    ``structured_outputs``, ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``,
    ``guided_whitespace_pattern``, ``structural_tag``; or those as keyword arguments. None: unconstrained."""
    def get(name):
        return fields[name] if name in fields else _get(request, name)

    sources = []
    rf = from_response_format(get("response_format"))
    if rf is not None:
        sources.append(("response_format", rf))
    so = from_structured_outputs(get("structured_outputs"))
    if so is not None:
        sources.append(("structured_outputs", so))
    guided = {name: get(name) for name in _GUIDED if get(name) is not None}
    if len(guided) > 1:
        a, b = sorted(guided)[:2]
        raise StructuredOutputsError(b, f"only one of {', '.join(_GUIDED)} may be given, got {a} and {b}")
    ws = get("guided_whitespace_pattern")
    if guided:
        (name, value), = guided.items()
        kwargs = {_GUIDED[name]: value}
        if ws is not None:
            kwargs["whitespace_pattern"] = ws
        sources.append((name, StructuredOutputsParams(
            **kwargs, field_names={_GUIDED[name]: name, "whitespace_pattern": "guided_whitespace_pattern"})))
    elif ws is not None:
        raise StructuredOutputsError("guided_whitespace_pattern", "given without guided_json")
    if len(sources) > 1:
        raise StructuredOutputsError(sources[1][0], f"only one structured-output request field may be given, got "
                                                    f"{sources[0][0]} and {sources[1][0]}")
    return sources[0][1] if sources else None
