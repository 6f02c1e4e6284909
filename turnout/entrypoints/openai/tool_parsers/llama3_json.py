"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole output is the call(s), optionally after ``<|python_tag|>``,
several separated by ``;``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}

An output whose first non-blank text is anything else is plain content (no tool call). An output that
starts like a call but is not one (no name, not JSON) is content too, sent whole when the stream ends.
"""

from __future__ import annotations

from turnout.entrypoints.openai.tool_parsers.base import ParseState, ToolParser, call_from_object
from turnout.entrypoints.openai.tool_parsers.json_scan import parse_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParseState:
        n = len(text)
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return ParseState()  # blank so far, or the tag still arriving
        if i >= n:
            return ParseState(content=text if final else "")
        if text[i] != "{":
            return ParseState(content=text if final else text.rstrip())
        state = ParseState()
        while True:
            obj = parse_object(text, i)
            call = call_from_object(text, obj, final)
            if call is None or obj.bad:
                return ParseState(content=text) if final else state
            state.calls.append(call)
            if not obj.closed:
                return state
            k = skip_ws(text, obj.end)
            if k >= n:
                return state
            if text[k] != ";":
                return ParseState(content=text) if final else state
            i = skip_ws(text, k + 1)
            if i >= n:
                return state
            if text[i] != "{":
                return ParseState(content=text) if final else state
