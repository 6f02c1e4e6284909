"""What a request constrains its output to: vLLM's ``StructuredOutputsParams``, by name and shape.

Exactly one kind is set: ``json`` (a JSON schema, dict or string), ``json_object`` (any JSON object),
``regex``, ``choice`` (the output is exactly one of the strings), ``grammar`` (EBNF, xgrammar's dialect,
GBNF-like) or ``structural_tag`` (xgrammar's structural tag, JSON). Construction checks the shape and
builds the grammar, tokenizer-free (milliseconds), so an invalid schema, regex or grammar is a
``StructuredOutputsError`` (a ValueError) naming the field, at the request's door rather than in the
engine. Compiling it against a vocabulary is turnout/structured/compiler.py's job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The constraint fields, in the order an error lists them.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class StructuredOutputsError(ValueError):
    """An invalid structured-output request. ``field`` is the request field at fault (the server's 400
    names it as ``param``); the message starts with it."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False  # accepted for vLLM compatibility: there is one backend, xgrammar
    disable_any_whitespace: bool = False  # JSON without whitespace between elements
    disable_additional_properties: bool = False  # xgrammar's default already (properties not in the schema are refused)
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # The request field each constraint came from (e.g. "response_format.json_schema.schema"), for errors;
    # not part of the constraint's identity.
    field_names: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise self.error(name, f"must be a boolean, got {type(getattr(self, name)).__name__}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise self.error("json_object", f"must be a boolean, got {type(self.json_object).__name__}")
        given = [k for k in KINDS if self._is_set(k)]
        if not given:
            raise self.error("structured_outputs", f"no constraint given: set exactly one of {', '.join(KINDS)}")
        if len(given) > 1:
            raise self.error(given[1], f"only one structured-output constraint may be given, got "
                                       f"{' and '.join(self.field_name(k) for k in given)}")
        if self.whitespace_pattern is not None:
            raise self.error("whitespace_pattern", "not supported by the xgrammar backend; use "
                                                   "disable_any_whitespace for compact JSON")
        self._check_value()
        from turnout.structured.grammar import build_grammar

        build_grammar(self)  # raises StructuredOutputsError naming the field

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return bool(value) if kind == "json_object" else value is not None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._is_set(k))

    def field_name(self, name: str) -> str:
        return self.field_names.get(name, name)

    def error(self, name: str, reason: str) -> StructuredOutputsError:
        return StructuredOutputsError(self.field_name(name), reason)

    def _check_value(self) -> None:
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError as e:
                    raise self.error("json", f"not valid JSON: {e}") from None
            else:
                parsed = value
            if not isinstance(parsed, (dict, bool)):
                raise self.error("json", f"a JSON schema must be an object (or a boolean), got {type(parsed).__name__}")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise self.error(kind, "must be a non-empty string")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value:
                raise self.error("choice", "must be a non-empty list of strings")
            bad = [c for c in value if not isinstance(c, str)]
            if bad:
                raise self.error("choice", f"every choice must be a string, got {bad[0]!r}")
        elif kind == "structural_tag":
            if isinstance(value, dict):
                return
            if not isinstance(value, str):
                raise self.error("structural_tag", f"must be a JSON string, got {type(value).__name__}")
            try:
                json.loads(value)
            except json.JSONDecodeError as e:
                raise self.error("structural_tag", f"not valid JSON: {e}") from None

    def cache_key(self) -> tuple:
        """The canonical identity of the constraint: equal keys compile to the same grammar. A JSON schema
        is re-serialised compactly in its own key order (xgrammar emits properties in schema order, so two
        orders are two grammars)."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            value = json.loads(value) if isinstance(value, str) else value
            value = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            value = tuple(value)
        return (kind, value, self.disable_any_whitespace)

    def schema(self) -> dict | bool | None:
        """The JSON schema as an object (json kind), else None."""
        if self.kind != "json":
            return None
        return json.loads(self.json) if isinstance(self.json, str) else self.json
