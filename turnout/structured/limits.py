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
    max_repeat: int = 256  # a regex bound {n,m}, multiplied through nested groups
    max_total_repeat: int = 1024  # those of one regex / grammar added up


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


def check_schema(schema, limits: SpecLimits = DEFAULT_LIMITS) -> None:
    """A JSON schema (parsed) within the limits: depth, size, enum values, regex bounds, and references
    local to the document (a remote ``$ref`` would be treated as "any value" by the compiler). Also a
    structural tag: its schemas, regexes and grammars are found the same way."""
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
            if isinstance(v.get("patternProperties"), dict):
                for key in v["patternProperties"]:
                    check_regex(key, limits)
            if v.get("type") == "grammar" and isinstance(v.get("grammar"), str):  # a structural tag's EBNF
                check_grammar(v["grammar"], limits)
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


def regex_repeat(pattern: str) -> tuple[int, int]:
    """(the largest repetition count of a regex, all of them added up), each multiplied through its
    enclosing groups: ``b{1,10000}`` -> (10000, 10000), ``(a{1,10}){1,10}x{5}`` -> (100, 105). That is
    what the grammar unrolls; ``*`` and ``+`` are loops and count nothing. What a repetition costs
    depends on what it repeats (xgrammar 0.2.9, SmolLM2's vocabulary: ``b{1,1000}`` compiles in 1 ms,
    ``[a-z]{1,100}`` in 0.9 s, ``.{1,1000}`` in 9 s), so the bounds are kept low."""
    frames = [[1, 0]]  # per open group: [largest count inside, total inside]
    i, n = 0, len(pattern)
    last = (1, 1)  # (largest, total) of the atom just read, for a quantifier after it
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            last = (1, 1)
            continue
        if c == "[":  # a character class: skip to its end ("]" first in the class is literal)
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i, last = j + 1, (1, 1)
            continue
        if c == "(":
            frames.append([1, 0])
            i += 1
            continue
        if c == ")":
            inner = frames.pop() if len(frames) > 1 else [1, 0]
            last = (inner[0], -max(inner[1], 1))  # negative: a group, its total already counted once
            frames[-1][0] = max(frames[-1][0], inner[0])
            frames[-1][1] += inner[1]
            i += 1
            continue
        m = _QUANT.match(pattern, i) if c == "{" else None
        if m:
            bound = max(int(m.group(1)), int(m.group(2)) if m.group(2) else 0, 1)
            frames[-1][0] = max(frames[-1][0], last[0] * bound)
            frames[-1][1] += last[1] * bound if last[1] > 0 else -last[1] * (bound - 1)
            i = m.end()
            last = (1, 1)
            continue
        last = (1, 1)
        i += 1
    while len(frames) > 1:  # unbalanced: xgrammar refuses it; count what is there
        inner = frames.pop()
        frames[-1][0] = max(frames[-1][0], inner[0])
        frames[-1][1] += inner[1]
    return frames[0][0], frames[0][1]


def _check_repeat(text: str, limits: SpecLimits, what: str) -> None:
    largest, total = regex_repeat(text)
    if largest > limits.max_repeat:
        raise SpecTooLarge(f"{what} repetition of up to {largest} (a bound like {{n,m}}, multiplied through nested "
                           f"groups), over the limit of {limits.max_repeat}")
    if total > limits.max_total_repeat:
        raise SpecTooLarge(f"{what} repetitions adding up to {total} (bounds like {{n,m}}), over the limit of "
                           f"{limits.max_total_repeat}")


def check_regex(pattern: str, limits: SpecLimits = DEFAULT_LIMITS) -> None:
    check_text(pattern, limits, "the regex")
    _check_repeat(pattern, limits, "regex")


_EBNF_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)


def check_grammar(text: str, limits: SpecLimits = DEFAULT_LIMITS) -> None:
    """An EBNF grammar: its size, and the repetition bounds of its rules and character classes (string
    literals, which may hold braces, are skipped)."""
    check_text(text, limits, "the grammar")
    _check_repeat(_EBNF_STRING.sub('""', text), limits, "grammar")


LIGHT_NODES = 256  # JSON values of a spec ...
LIGHT_REPEAT = 64  # ... and repetition (of every string, read as a regex) that compile in milliseconds


def is_light(values) -> bool:
    """Whether a request's constraint fields (parsed JSON: dicts, lists, strings) are small enough to
    compile in milliseconds whatever they mean: few JSON values, and every string, read as a regex, with
    little repetition. A conservative guess, for choosing a worker lane, made on small bodies only (it
    walks everything)."""
    nodes = 0
    stack = list(values)
    while stack:
        v = stack.pop()
        nodes += 1
        if nodes > LIGHT_NODES:
            return False
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            if v[:1] in ("{", "[") and len(v) > 1:  # JSON in a string (guided_json, a structural tag)
                try:
                    stack.append(loads_json(v, 32))
                    continue
                except ValueError:
                    return False
            if regex_repeat(v)[1] > LIGHT_REPEAT:
                return False
    return True
