"""``openai``: tool calls in GPT-OSS's harmony format (turnout/entrypoints/openai/harmony.py)::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

Each message with a recipient is a call (``functions.NAME`` -> NAME), its body the arguments as the model wrote
them; the bodies of the messages to the user (``final``, ``commentary`` preambles, text outside any header) are
the content. ``analysis`` messages are reasoning, the ``openai_gptoss`` reasoning parser's: without it they are
dropped, never shown as content. It reads the raw harmony text or the content the reasoning parser leaves alike."""

from __future__ import annotations

from turnout.entrypoints.openai.harmony import function_name, split_messages
from turnout.entrypoints.openai.tool_parsers.base import ParseState, PartialCall, ToolParser


class OpenAIToolParser(ToolParser):
    name = "openai"

    def parse(self, text: str, final: bool) -> ParseState:
        state = ParseState()
        content: list[str] = []
        for m in split_messages(text, final):
            if m.channel == "analysis":
                continue
            if m.recipient is None:
                content.append(m.body)
                continue
            # trailing whitespace held back in a stream and dropped at the end, so both agree
            state.calls.append(PartialCall(function_name(m.recipient), m.body.strip()))
        state.content = "".join(content)
        return state
