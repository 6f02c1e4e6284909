"""Cheap checks of a structured-output spec before any grammar is built.

Building and compiling a grammar costs time and memory that grow with the spec in ways a client controls
(xgrammar 0.2.9 on the SmolLM2 vocabulary: a schema ``pattern`` of ``b{1,8000}`` takes 3.6 s to build, a
20000-value enum 2.1 s and 83 MB compiled, a schema 190 levels deep 0.8 s). These checks run in
microseconds to milliseconds on the spec's text and bound each of those costs, so that what reaches the
compiler finishes in well under a second; each refusal is a StructuredOutputsError naming the request
field. The bounds are generous next to real schemas (OpenAI's structured outputs allow 10 levels of
nesting, 5000 properties and 1000 enum values).

``loads_json`` parses JSON carried inside a string field (``guided_json``, a tool's ``arguments``) with a
depth bound, so that a deeply nested text is a 400 naming the field rather than a RecursionError.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# Nesting of JSON text inside a string field. The request body's own parser (pydantic's jiter) stops at
# about 240 levels; text carried in a string gets the same order of bound, below Python's recursion limit.
MAX_JSON_DEPTH = 200


@dataclass(frozen=True)
class SpecLimits:
    max_spec_bytes: int = 256 << 10  # a schema / structural tag, serialised; a grammar's or regex's text
    max_schema_depth: int = 64  # JSON nesting of a schema (about 20 levels of nested objects)
    max_schema_nodes: int = 20000  # JSON values in a schema (objects, arrays, scalars)
    max_enum_values: int = 4096  # enum / const / choice values, over the whole spec
    max_enum_bytes: int = 128 << 10  # their total text
    max_repeat: int = 1000  # a regex bound {n,m}, multiplied through nested groups


DEFAULT_LIMITS = SpecLimits()


class SpecTooLarge(ValueError):
    """A spec over one of the limits: ``reason`` says which (the caller prefixes the field)."""


def json_depth(text: str) -> int:
    """The bracket nesting depth of JSON text (strings skipped), without parsing it."""
    depth = top = 0
    for m in _BRACKETS.finditer(text):
        tok = m.group()
        if tok[0] == '"':
            continue
        depth += 1 if tok in "[{" else -1
        top = max(top, depth)
    return top


_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)


def loads_json(text: str, max_depth: int = MAX_JSON_DEPTH):
    """json.loads with a nesting bound: ValueError (json.JSONDecodeError for bad JSON, SpecTooLarge for
    too deep) instead of a RecursionError."""
    depth = json_depth(text)
    if depth > max_depth:
        raise SpecTooLarge(f"JSON nested {depth} levels deep, over the limit of {max_depth}")
    try:
        return json.loads(text)
    except RecursionError:  # pragma: no cover - the depth bound is below the recursion limit
        raise SpecTooLarge(f"JSON nested too deeply (limit {max_depth})") from None


def check_json_value(value, max_depth: int = MAX_JSON_DEPTH) -> None:
    """An already-parsed JSON value (a dict from the body) within the depth bound; iterative."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > max_depth:
                raise SpecTooLarge(f"JSON nested more than {max_depth} levels deep")
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))


def check_schema(schema, limits: SpecLimits = DEFAULT_LIMITS) -> None:
    """A JSON schema (parsed) within the limits: depth, size, enum values, regex bounds, and references
    local to the document (a remote ``$ref`` would be treated as "any value" by the compiler)."""
    nodes = enum_values = enum_bytes = 0
    stack = [(schema, 1)]
    while stack:
        v, d = stack.pop()
        nodes += 1
        if nodes > limits.max_schema_nodes:
            raise SpecTooLarge(f"the schema has more than {limits.max_schema_nodes} JSON values")
        if isinstance(v, dict):
            if d > limits.max_schema_depth:
                raise SpecTooLarge(f"the schema is nested more than {limits.max_schema_depth} levels deep")
            ref = v.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                raise SpecTooLarge(f"$ref {ref[:100]!r}: only references inside the schema (#/...) are supported, "
                                   "nothing is fetched")
            pattern = v.get("pattern")
            if isinstance(pattern, str):
                check_regex(pattern, limits)
            for key in ("enum", "const"):
                if key in v:
                    vals = v[key] if key == "enum" and isinstance(v[key], list) else [v[key]]
                    enum_values += len(vals)
                    enum_bytes += sum(len(x) if isinstance(x, str) else len(json.dumps(x)) for x in vals)
            stack.extend((c, d + 1) for c in v.values())
        elif isinstance(v, list):
            if d > limits.max_schema_depth:
                raise SpecTooLarge(f"the schema is nested more than {limits.max_schema_depth} levels deep")
            stack.extend((c, d + 1) for c in v)
    _check_values(enum_values, enum_bytes, limits, "enum/const")


def check_choices(choices, limits: SpecLimits = DEFAULT_LIMITS) -> None:
    _check_values(len(choices), sum(len(c) for c in choices), limits, "choice")


def _check_values(count: int, total: int, limits: SpecLimits, what: str) -> None:
    if count > limits.max_enum_values:
        raise SpecTooLarge(f"{count} {what} values, over the limit of {limits.max_enum_values}")
    if total > limits.max_enum_bytes:
        raise SpecTooLarge(f"{what} values of {total} characters in all, over the limit of {limits.max_enum_bytes}")


def check_text(text: str, limits: SpecLimits = DEFAULT_LIMITS, what: str = "the spec") -> None:
    if len(text) > limits.max_spec_bytes:
        raise SpecTooLarge(f"{what} is {len(text)} characters, over the limit of {limits.max_spec_bytes}")


_QUANT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def regex_repeat(pattern: str) -> int:
    """The largest repetition count of a regex, multiplied through nested groups: ``b{1,10000}`` -> 10000,
    ``(a{1,10}){1,10}`` -> 100 (what the grammar expands; ``*`` and ``+`` are loops and count 1)."""
    frames = [1]  # the largest count inside each open group
    i, n = 0, len(pattern)
    last = 1  # the count of the atom just closed (a group's inner count), for a quantifier after it
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            last = 1
            continue
        if c == "[":  # a character class: skip to its end ("]" first in the class is literal)
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        if c == "(":
            frames.append(1)
            i += 1
            last = 1
            continue
        if c == ")":
            last = frames.pop() if len(frames) > 1 else 1
            frames[-1] = max(frames[-1], last)
            i += 1
            continue
        m = _QUANT.match(pattern, i) if c == "{" else None
        if m:
            bound = max(int(m.group(1)), int(m.group(2)) if m.group(2) else 0, 1)
            frames[-1] = max(frames[-1], last * bound)
            i = m.end()
            last = 1
            continue
        last = 1
        i += 1
    return max(frames)


def check_regex(pattern: str, limits: SpecLimits = DEFAULT_LIMITS) -> None:
    check_text(pattern, limits, "the regex")
    count = regex_repeat(pattern)
    if count > limits.max_repeat:
        raise SpecTooLarge(f"regex repetition of up to {count} (a bound like {{n,m}}, multiplied through nested "
                           f"groups), over the limit of {limits.max_repeat}")


_EBNF_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', re.S)


def check_grammar(text: str, limits: SpecLimits = DEFAULT_LIMITS) -> None:
    """An EBNF grammar: its size, and the repetition bounds of its rules and character classes (string
    literals, which may hold braces, are skipped)."""
    check_text(text, limits, "the grammar")
    count = regex_repeat(_EBNF_STRING.sub('""', text))
    if count > limits.max_repeat:
        raise SpecTooLarge(f"grammar repetition of up to {count}, over the limit of {limits.max_repeat}")
