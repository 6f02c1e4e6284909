"""Reasoning parsers: ``<think>`` ... ``</think>`` goes to ``reasoning_content``, the rest to ``content``.

As with the tool parsers, one function ``parse(text, final)`` serves the complete output and the stream:
with ``final=False`` it returns only what can no longer change (a suffix that may begin ``</think>`` is
held back, as is reasoning that is only whitespace so far), so the streamed deltas concatenate to the
complete parse of the same text, at every split.

Whether the output starts inside the reasoning depends on the chat template: DeepSeek-R1's (and Qwen3
thinking-only models') put ``<think>`` at the end of the prompt, so the output is reasoning until
``</think>``; Qwen3's hybrid models write ``<think>`` themselves. ``opened_in_prompt`` says which (None:
the parser's default); ``opened_by_prompt(prompt_text)`` reads it off the rendered prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnout.entrypoints.openai.tool_parsers.json_scan import held_back


@dataclass
class ReasoningDelta:
    reasoning_content: str | None = None
    content: str | None = None

    def to_openai(self) -> dict:
        return {k: v for k, v in (("reasoning_content", self.reasoning_content), ("content", self.content))
                if v is not None}


class ReasoningParser:
    name = ""
    start = "<think>"
    end = "</think>"
    default_opened = False
    keeps_special_tokens = False  # its markers are special tokens: the server detokenises with them

    def __init__(self, opened_in_prompt: bool | None = None):
        self.opened = self.default_opened if opened_in_prompt is None else opened_in_prompt

    @classmethod
    def opened_by_prompt(cls, prompt_text: str) -> bool:
        """Whether a rendered prompt leaves the model inside its reasoning (it ends with the start tag)."""
        return prompt_text.rstrip().endswith(cls.start)

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning so far, content so far)."""
        body = text
        lead = text.lstrip()
        if not final and self.start.startswith(lead):
            return "", ""  # blank so far, or the start tag still arriving
        if lead.startswith(self.start):
            body = lead[len(self.start):]
        elif not self.opened:
            return "", text  # no reasoning in this output
        e = body.find(self.end)
        if e >= 0:
            reasoning, content = body[:e], body[e + len(self.end):].lstrip()
        else:
            reasoning = body if final else body[: len(body) - held_back(body, (self.end,))]
            content = ""
        if not reasoning.strip():
            reasoning = ""  # whitespace only: no reasoning (and nothing streamed until there is some)
        return reasoning, content

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a complete output; None for an empty part."""
        reasoning, content = self.parse(text, final=True)
        return reasoning or None, content or None

    def reasoning_ended(self, text: str) -> bool:
        """Whether the output so far has left the reasoning (structured output is enforced from there on)."""
        lead = text.lstrip()
        if lead.startswith(self.start) or self.opened:
            return self.end in text
        return bool(lead) and not self.start.startswith(lead)

    def streaming(self) -> "StreamingReasoningParser":
        return StreamingReasoningParser(self)


class StreamingReasoningParser:
    """Per-request streaming state: ``feed(delta_text)``, then ``finish()``; each returns a ReasoningDelta or
    None when there is nothing to send yet."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.sent = ("", "")

    def feed(self, delta_text: str) -> ReasoningDelta | None:
        self.text += delta_text
        return self._diff(self.parser.parse(self.text, final=False))

    def finish(self) -> ReasoningDelta | None:
        return self._diff(self.parser.parse(self.text, final=True))

    def _diff(self, state: tuple[str, str]) -> ReasoningDelta | None:
        parts = []
        for now, before in zip(state, self.sent):
            parts.append(now[len(before):] if len(now) > len(before) and now.startswith(before) else None)
        self.sent = tuple(now if part is not None else before for now, before, part in zip(state, self.sent, parts))
        if parts[0] is None and parts[1] is None:
            return None
        return ReasoningDelta(*parts)


def assemble_reasoning(deltas) -> tuple[str | None, str | None]:
    reasoning = content = None
    for d in deltas:
        if d is None:
            continue
        if d.reasoning_content is not None:
            reasoning = (reasoning or "") + d.reasoning_content
        if d.content is not None:
            content = (content or "") + d.content
    return reasoning, content
