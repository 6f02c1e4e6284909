"""Tool-call parsing: one parse function per model format, used both for a complete text and for a stream.

A parser implements ``parse(text, final) -> ParseState``: the content so far and the tool calls so far
(each with its name once the name is complete, and the raw arguments text so far). With ``final=False``
the state only ever grows as text is appended: content holds back a suffix that may begin a tool-call
marker (and trailing whitespace), a call appears once its name is known, and its arguments are a prefix
of what they will be. ``extract_tool_calls`` is the complete parse; ``StreamingToolParser`` feeds deltas
and emits the difference of successive states as OpenAI-shaped deltas, so a stream assembles to the
complete parse of the same text (for a well-formed text; a tool call that turns out malformed at the end
makes the complete parse return the whole text as content, while a stream cannot take back what it sent).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as the model wrote it
    id: str = ""
    type: str = "function"

    def to_openai(self) -> dict:
        return {"id": self.id, "type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class PartialCall:
    name: str | None  # None until the name is complete
    arguments: str = ""  # raw text so far ("{}" filled in by the final parse when the model gave none)


@dataclass
class ParseState:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class DeltaMessage:
    """One streamed delta: OpenAI's ``choices[i].delta`` with ``content`` and/or ``tool_calls``."""

    content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)

    def to_openai(self) -> dict:
        out: dict = {}
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class ToolParser:
    """Base class: a subclass sets ``name`` and implements ``parse``."""

    name = ""

    def parse(self, text: str, final: bool) -> ParseState:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        state = self.parse(text, final=True)
        calls = [ToolCall(c.name, c.arguments or "{}", self.new_call_id()) for c in state.calls]
        content = state.content if state.content else None
        return ExtractedToolCalls(bool(calls), calls, content)

    def streaming(self) -> "StreamingToolParser":
        return StreamingToolParser(self)


class StreamingToolParser:
    """Per-request streaming state: ``feed(delta_text)`` and, at the end, ``finish()``; each returns a
    DeltaMessage or None when there is nothing to send yet. ``tool_calls`` holds the calls sent so far."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.content_sent = ""
        self.tool_calls: list[ToolCall] = []

    def feed(self, delta_text: str) -> DeltaMessage | None:
        self.text += delta_text
        return self._diff(self.parser.parse(self.text, final=False))

    def finish(self) -> DeltaMessage | None:
        return self._diff(self.parser.parse(self.text, final=True))

    def _diff(self, state: ParseState) -> DeltaMessage | None:
        delta = DeltaMessage()
        if len(state.content) > len(self.content_sent) and state.content.startswith(self.content_sent):
            delta.content = state.content[len(self.content_sent):]
            self.content_sent = state.content
        for index, call in enumerate(state.calls):
            if call.name is None:
                break  # a later call cannot be announced before this one's name
            if index == len(self.tool_calls):
                sent = ToolCall(call.name, call.arguments, self.parser.new_call_id())
                self.tool_calls.append(sent)
                delta.tool_calls.append({"index": index, "id": sent.id, "type": "function",
                                         "function": {"name": call.name, "arguments": call.arguments}})
                continue
            sent = self.tool_calls[index]
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                delta.tool_calls.append({"index": index,
                                         "function": {"arguments": call.arguments[len(sent.arguments):]}})
                sent.arguments = call.arguments
        return delta if delta.content is not None or delta.tool_calls else None


def assemble(deltas) -> tuple[str | None, list[dict]]:
    """What a client builds from a stream of DeltaMessages (or their OpenAI dicts): (content, tool calls as
    ``{"id", "type", "function": {"name", "arguments"}}``)."""
    content, calls = None, {}
    for d in deltas:
        if d is None:
            continue
        d = d.to_openai() if isinstance(d, DeltaMessage) else d
        if d.get("content") is not None:
            content = (content or "") + d["content"]
        for tc in d.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"id": None, "type": "function", "function": {"name": None,
                                                                                            "arguments": ""}})
            if tc.get("id"):
                slot["id"] = tc["id"]
            fn = tc.get("function", {})
            if fn.get("name"):
                slot["function"]["name"] = fn["name"]
            slot["function"]["arguments"] += fn.get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def content_before(text: str, markers: tuple[str, ...]) -> str:
    """Streamed content that is safe to send: without a suffix that may begin a marker, and without trailing
    whitespace (it is dropped if a tool call follows)."""
    from turnout.entrypoints.openai.tool_parsers.json_scan import held_back

    keep = len(text) - held_back(text, markers)
    return text[:keep].rstrip()


def call_from_object(text: str, obj, final: bool) -> PartialCall | None:
    """A PartialObject ``{"name": ..., "arguments" | "parameters": {...}}`` as a call; in the final parse
    None when it is not a complete call with object arguments."""
    from turnout.entrypoints.openai.tool_parsers.json_scan import is_json_object

    name = obj.complete_string(text, "name")
    key = next((k for k in ("arguments", "parameters") if k in obj.fields), None)
    args = obj.raw(text, key) if key is not None else ""
    if final:
        if obj.bad or not obj.closed or name is None:
            return None
        if key is None:
            args = "{}"
        elif not is_json_object(args):
            return None
    return PartialCall(name, args if name is not None else "")
