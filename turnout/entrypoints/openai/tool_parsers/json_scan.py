"""Scanning JSON that may still be arriving: where a value ends, or that the text ends inside it.

The tool parsers read a tool call's raw JSON text as it streams. They never re-serialise it: a call's
``arguments`` is exactly the text the model wrote for that value, so what streams out in pieces
concatenates to what the complete parse returns.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from turnout.structured.limits import loads_json

WS = " \t\n\r"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_STRUCT = re.compile(r'["{}\[\]]')
_PRIMITIVE_END = re.compile(r"[,}\]\s]")


def skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in WS:
        i += 1
    return i


def scan_string(s: str, i: int) -> int | None:
    """s[i] is '"': the index after the closing quote, or None if the text ends inside the string."""
    m = _STRING.match(s, i)
    return m.end() if m else None


def scan_value(s: str, i: int) -> int | None:
    """The end of the JSON value that starts at s[i] (not whitespace), or None if the text ends inside it.
    Only the nesting is checked here; json.loads judges the finished text."""
    c = s[i]
    if c == '"':
        return scan_string(s, i)
    if c in "{[":
        depth, j = 0, i
        while True:
            m = _STRUCT.search(s, j)
            if m is None:
                return None
            ch = m.group()
            if ch == '"':
                end = scan_string(s, m.start())
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if ch in "{[" else -1
            j = m.end()
            if depth == 0:
                return j
    m = _PRIMITIVE_END.search(s, i)
    return m.start() if m else None  # a number at the very end may still grow


@dataclass
class PartialObject:
    """A JSON object read so far: each key's raw value span (end None: still arriving)."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    closed: bool = False
    end: int | None = None  # after the closing brace
    bad: bool = False  # not JSON whatever follows

    def raw(self, s: str, key: str) -> str | None:
        span = self.fields.get(key)
        if span is None:
            return None
        start, end = span
        return s[start:end] if end is not None else s[start:]

    def complete_string(self, s: str, key: str) -> str | None:
        span = self.fields.get(key)
        if span is None or span[1] is None:
            return None
        try:
            value = json.loads(s[span[0]:span[1]])
        except (ValueError, RecursionError):  # the model's text: nested too deeply is not a value either
            return None
        return value if isinstance(value, str) else None


def parse_object(s: str, i: int) -> PartialObject:
    """s[i] is '{': read its members as far as the text goes."""
    obj = PartialObject()
    i += 1
    n = len(s)
    expect_member = True
    while True:
        i = skip_ws(s, i)
        if i >= n:
            return obj
        c = s[i]
        if c == "}":
            obj.closed, obj.end = True, i + 1
            return obj
        if c == "," and not expect_member:
            expect_member = True
            i += 1
            continue
        if c != '"' or not expect_member:
            obj.bad = True
            return obj
        kend = scan_string(s, i)
        if kend is None:
            return obj
        try:
            key = json.loads(s[i:kend])
        except ValueError:  # an invalid escape in the key
            obj.bad = True
            return obj
        i = skip_ws(s, kend)
        if i >= n:
            return obj
        if s[i] != ":":
            obj.bad = True
            return obj
        i = skip_ws(s, i + 1)
        if i >= n:
            return obj
        vend = scan_value(s, i)
        obj.fields[key] = (i, vend)
        if vend is None:
            return obj
        i = vend
        expect_member = False


def is_json_object(text: str) -> bool:
    """Whether the model's text is a JSON object; text nested deeper than the server parses (a model can
    write ``[[[[...`` a thousand deep) is not one, so the call becomes content instead of a crash."""
    try:
        return isinstance(loads_json(text), dict)
    except ValueError:  # bad JSON or too deep (SpecTooLarge)
        return False


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of a streamed text might begin one of ``markers`` (not yet content)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                best = max(best, k)
                break
    return best
