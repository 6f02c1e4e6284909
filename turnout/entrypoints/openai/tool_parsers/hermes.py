"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes 2/3, and many fine-tunes):

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    ...

Content is the text before the first ``<tool_call>``; text between or after the calls is dropped. A
closing ``</tool_call>`` missing at the very end (the model stopped right after the JSON) is forgiven.
"""

from __future__ import annotations

from turnout.entrypoints.openai.tool_parsers.base import ParseState, ToolParser, call_from_object, content_before
from turnout.entrypoints.openai.tool_parsers.json_scan import parse_object, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParseState:
        first = text.find(START)
        if first < 0:
            return ParseState(content=text if final else content_before(text, (START,)))
        state = ParseState(content=text[:first].rstrip())
        pos, n = first, len(text)
        while True:
            i = skip_ws(text, pos + len(START))
            if i >= n:
                break
            if text[i] != "{":
                return self._malformed(text, state, final)
            obj = parse_object(text, i)
            call = call_from_object(text, obj, final)
            if call is None:
                return self._malformed(text, state, final)
            state.calls.append(call)
            if obj.bad:
                return self._malformed(text, state, final)
            if not obj.closed:
                break
            k = skip_ws(text, obj.end)
            if text.startswith(END, k):
                pos = text.find(START, k + len(END))
                if pos < 0:
                    break
                continue
            if k >= n or END.startswith(text[k:]):
                break  # the closing tag is still arriving, or the model ended after the JSON
            return self._malformed(text, state, final)
        return state

    @staticmethod
    def _malformed(text: str, state: ParseState, final: bool) -> ParseState:
        # Final: not a tool call after all, all of it is content. Streaming: keep what was sent.
        return ParseState(content=text) if final else state
