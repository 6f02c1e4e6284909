"""Mistral tool calls, both generations of the format:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]   (v0.3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]other[ARGS]{...}            (v11+ tokenizers)

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens: the server must detokenise with
``skip_special_tokens=False`` for this parser (as vLLM does for Mistral models with tools). Content is the
text before the first ``[TOOL_CALLS]``. Call ids are 9 letters and digits, as Mistral's chat template
requires when the calls are sent back.
"""

from __future__ import annotations

import random
import string

from turnout.entrypoints.openai.tool_parsers.base import (
    ParseState,
    PartialCall,
    ToolParser,
    call_from_object,
    content_before,
)
from turnout.entrypoints.openai.tool_parsers.json_scan import is_json_object, parse_object, scan_value, skip_ws

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"

    def new_call_id(self) -> str:
        return "".join(random.SystemRandom().choice(_ID_CHARS) for _ in range(9))

    def parse(self, text: str, final: bool) -> ParseState:
        first = text.find(TOOL_CALLS)
        if first < 0:
            return ParseState(content=text if final else content_before(text, (TOOL_CALLS,)))
        state = ParseState(content=text[:first].rstrip())
        i = skip_ws(text, first + len(TOOL_CALLS))
        if i >= len(text):
            return state
        ok = (parse_array(text, i, final, state.calls) if text[i] == "["
              else self._parse_named(text, i, final, state.calls))
        return state if ok else (ParseState(content=text) if final else state)

    @staticmethod
    def _parse_named(text: str, i: int, final: bool, calls: list) -> bool:
        """``name[ARGS]{...}`` repeated with ``[TOOL_CALLS]`` between; False: malformed."""
        n = len(text)
        while True:
            j = text.find(ARGS, i)
            if j < 0:
                return not final  # the name (or its [ARGS]) is still arriving
            name = text[i:j].strip()
            if not name or any(c in name for c in '{}[]"'):
                return False
            a = skip_ws(text, j + len(ARGS))
            if a >= n:
                if final:
                    return False
                calls.append(PartialCall(name, ""))
                return True
            end = scan_value(text, a)
            args = text[a:end] if end is not None else text[a:]
            if final and (end is None or not is_json_object(args)):
                return False
            calls.append(PartialCall(name, args))
            if end is None:
                return True
            k = skip_ws(text, end)
            if k >= n:
                return True
            if text.startswith(TOOL_CALLS, k):
                i = skip_ws(text, k + len(TOOL_CALLS))
                continue
            return not final and TOOL_CALLS.startswith(text[k:])


def parse_array(text: str, i: int, final: bool, calls: list) -> bool:
    """``[{"name": ..., "arguments": ...}, ...]`` starting at text[i] == '['; appends the calls read so far.
    False: malformed. In the final parse, the array must be closed and every call complete."""
    n = len(text)
    i += 1
    expect_item = True
    while True:
        i = skip_ws(text, i)
        if i >= n:
            return not final
        c = text[i]
        if c == "]":
            return bool(calls) or not final
        if c == "," and not expect_item:
            expect_item, i = True, i + 1
            continue
        if c != "{" or not expect_item:
            return False
        obj = parse_object(text, i)
        call = call_from_object(text, obj, final)
        if call is None or obj.bad:
            return False
        calls.append(call)
        if not obj.closed:
            return not final
        i, expect_item = obj.end, False
