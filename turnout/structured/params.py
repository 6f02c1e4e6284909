"""What a request constrains its output to: vLLM's ``StructuredOutputsParams``, by name and shape.

Exactly one kind is set: ``json`` (a JSON schema, dict or string), ``json_object`` (any JSON object),
``regex``, ``choice`` (the output is exactly one of the strings), ``grammar`` (EBNF, xgrammar's dialect,
GBNF-like) or ``structural_tag`` (xgrammar's structural tag, JSON). Construction checks the shape and
the size limits (turnout/structured/limits.py: depth, size, enum values, regex repetition, local
``$ref`` only) and builds the grammar, tokenizer-free, so an invalid or oversized schema, regex or
grammar is a ``StructuredOutputsError`` (a ValueError) naming the field, at the request's door rather
than in the engine. Compiling it against a vocabulary is turnout/structured/compiler.py's job. Building
can take up to a fraction of a second within the limits: the server constructs params off its event
loop (turnout/structured/workers.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from turnout.structured.limits import (
    DEFAULT_LIMITS,
    SpecTooLarge,
    check_choices,
    check_grammar,
    check_regex,
    check_schema,
    check_text,
    loads_json,
)

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

        self._grammar = build_grammar(self)  # raises StructuredOutputsError naming the field

    def grammar_object(self):
        """The xgrammar Grammar built at construction (what the compiler compiles)."""
        return self._grammar

    def __getstate__(self):  # copies and pickles carry the spec, not the xgrammar objects built from it
        return {k: v for k, v in self.__dict__.items() if k not in ("_grammar", "_compiled")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        from turnout.structured.grammar import build_grammar

        self._grammar = build_grammar(self)

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
        try:
            self._check_kind(kind, getattr(self, kind))
        except SpecTooLarge as e:
            raise self.error(kind, str(e)) from None

    def _parse(self, kind: str, value):
        """A JSON field given as text -> its value, within the depth and size limits."""
        if not isinstance(value, str):
            return value
        check_text(value, DEFAULT_LIMITS)
        try:
            return loads_json(value)
        except json.JSONDecodeError as e:
            raise self.error(kind, f"not valid JSON: {e}") from None

    @staticmethod
    def _check_spec(parsed) -> None:
        check_schema(parsed)  # first: it stops early on a huge or deep value, before anything serialises it
        if isinstance(parsed, (dict, list)):
            check_text(json.dumps(parsed), DEFAULT_LIMITS)

    def _check_kind(self, kind: str, value) -> None:
        if kind == "json":
            parsed = self._parse("json", value)
            if not isinstance(parsed, (dict, bool)):
                raise self.error("json", f"a JSON schema must be an object (or a boolean), got {type(parsed).__name__}")
            self._check_spec(parsed)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise self.error(kind, "must be a non-empty string")
            (check_regex if kind == "regex" else check_grammar)(value)
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value:
                raise self.error("choice", "must be a non-empty list of strings")
            bad = [c for c in value if not isinstance(c, str)]
            if bad:
                raise self.error("choice", f"every choice must be a string, got {bad[0]!r}")
            check_choices(value)
        elif kind == "structural_tag":
            if not isinstance(value, (str, dict)):
                raise self.error("structural_tag", f"must be a JSON string, got {type(value).__name__}")
            self._check_spec(self._parse("structural_tag", value))  # its schemas, patterns and enums

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
