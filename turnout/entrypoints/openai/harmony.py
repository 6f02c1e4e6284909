"""The harmony format GPT-OSS writes, split into its messages: what the ``openai_gptoss`` reasoning parser and the
``openai`` tool parser read (reasoning/harmony.py, tool_parsers/openai.py).

The chat template ends the prompt with ``<|start|>assistant``, so an answer reads::

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or, with no call, ``...<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>``. A message is
a header (the role after ``<|start|>``, ``<|channel|>`` and the channel, an optional recipient ``to=...`` before or
after the channel, an optional ``<|constrain|>`` content type) and, after ``<|message|>``, a body that runs to
``<|end|>``, ``<|return|>``, ``<|call|>`` or the next ``<|start|>``. The channels: ``analysis`` (reasoning),
``commentary`` (tool calls, which have a recipient, and preambles to the user, which do not), ``final`` (the
answer). The markers are special tokens: the server keeps them in the text for these parsers. The last end
marker is the stop token and is not in the text; text outside any header is content (a model that did not
answer in harmony). ``<|call|>`` and ``<|return|>`` end the turn: a text that goes on after one (an engine that
did not stop on it: GPT-OSS lists ``<|call|>`` only in its generation_config.json) is read up to it.

``split_messages(text, final)``: with ``final=False`` only what can no longer change: a header is reported once
it is complete, a body without a suffix that may begin a marker, so the reports of a growing text only grow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from turnout.entrypoints.openai.tool_parsers.json_scan import held_back

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
TURN_ENDS = ("<|return|>", "<|call|>")  # the stop tokens: the end of the assistant's turn
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT_RE = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


@dataclass
class Message:
    start: int  # offset of the message in the text (its <|start|>, or its header, or plain text)
    channel: str | None  # None: text outside any header
    recipient: str | None  # "functions.get_weather" for a tool call; None for a message to the user
    body: str
    body_end: int  # offset just past the body reported
    end: int  # offset past the end marker (== body_end while the message is open)
    done: bool  # its end marker (or the next message) was seen, or the text is complete


def raw_text(text: str, m: Message) -> str:
    """The message as written, header to end marker (to the reported body end while it is open)."""
    return text[m.start:m.end]


def _next_end(text: str, i: int) -> tuple[int, int]:
    """(offset of the first end marker or <|start|> at or after i, its length to consume), or (-1, 0)."""
    best, size = -1, 0
    for marker in (*ENDS, START):
        j = text.find(marker, i)
        if j >= 0 and (best < 0 or j < best):
            best, size = j, (0 if marker == START else len(marker))
    return best, size


def split_messages(text: str, final: bool) -> list[Message]:
    out: list[Message] = []
    pos, n = 0, len(text)
    while pos < n:
        rest = text[pos:]
        if not final and not rest.strip():
            break  # whitespace between messages: nothing to report yet
        if rest.startswith(START) or rest.startswith(CHANNEL) or rest.lstrip().startswith(CHANNEL):
            header_at = pos + len(START) if rest.startswith(START) else pos
            mi = text.find(MESSAGE, header_at)
            if mi < 0:
                break  # the header is still arriving (or was cut off: no body to report)
            header = text[header_at:mi]
            ch = _CHANNEL_RE.search(header)
            rcpt = _RECIPIENT_RE.search(header)
            body_at = mi + len(MESSAGE)
            channel = ch.group(1) if ch else "final"
            recipient = rcpt.group(1) if rcpt else None
        elif not final and any(m.startswith(rest) for m in (START, CHANNEL)):
            break  # a marker still arriving
        else:  # text outside any header: content up to the next message
            body_at, channel, recipient = pos, None, None
        e, size = _next_end(text, body_at)
        if e >= 0:
            out.append(Message(pos, channel, recipient, text[body_at:e], e, e + size, True))
            if text.startswith(TURN_ENDS, e):
                break  # the turn is over: whatever a model that was not stopped wrote after it is not the answer
            pos = e + size
            continue
        stop = n if final else n - held_back(text[body_at:], MARKERS)
        out.append(Message(pos, channel, recipient, text[body_at:stop], stop, stop, final))
        break
    return out


def function_name(recipient: str) -> str:
    """``functions.get_weather`` -> ``get_weather``; other recipients (built-in tools) as they are."""
    return recipient[len("functions."):] if recipient.startswith("functions.") else recipient
