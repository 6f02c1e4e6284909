"""``openai_gptoss``: GPT-OSS's harmony answer (turnout/entrypoints/openai/harmony.py) split into reasoning and
content. The ``analysis`` messages are the reasoning (several joined by a blank line); the bodies of the messages
to the user (``final``, and ``commentary`` preambles) are the content; a tool call (a message with a recipient) is
passed on in the content as written, for the ``openai`` tool parser, which the server runs next."""

from __future__ import annotations

from turnout.entrypoints.openai.harmony import raw_text, split_messages
from turnout.entrypoints.openai.reasoning.base import ReasoningParser

SEPARATOR = "\n\n"


class HarmonyReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    keeps_special_tokens = True  # the channel markers are special tokens: the text must keep them

    @classmethod
    def opened_by_prompt(cls, prompt_text: str) -> bool:
        return False  # the template opens the assistant's message, not a channel: the answer writes its own

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for m in split_messages(text, final):
            if m.channel == "analysis":
                reasoning.append(m.body)
            elif m.recipient is not None:
                content.append(raw_text(text, m))
            else:
                content.append(m.body)
        return SEPARATOR.join(reasoning), "".join(content)

    def reasoning_ended(self, text: str) -> bool:
        return any(m.channel != "analysis" for m in split_messages(text, final=False))
