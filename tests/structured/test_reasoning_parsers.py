"""Reasoning parsers on model-shaped outputs: complete parse, and streams split at every character boundary
that assemble to the complete parse; then reasoning followed by a hermes tool call, streamed through both
parsers in a chain (as the server does: reasoning first, the tool parser on the content)."""

from __future__ import annotations

import random

import pytest

from turnout.entrypoints.openai.reasoning import REASONING_PARSERS, assemble_reasoning, get_reasoning_parser
from turnout.entrypoints.openai.tool_parsers import assemble, get_tool_parser

# (parser, opened_in_prompt, text, reasoning, content)
CASES = [
    ("qwen3", None, "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\n2 + 2 = 4.",
     "\nThe user asks for 2+2. That is 4.\n", "2 + 2 = 4."),
    ("qwen3", None, "Hello there, no thinking today.", None, "Hello there, no thinking today."),
    ("qwen3", None, "<think>\n\n</think>\n\nHi!", None, "Hi!"),
    ("qwen3", None, "<think>\nLet me think about the <b>tags</b> and </thin", "\nLet me think about the <b>tags</b> "
     "and </thin", None),  # cut by max_tokens inside the reasoning
    ("qwen3", None, "Use the <think> tag like this: <think>x</think>", None,
     "Use the <think> tag like this: <think>x</think>"),
    ("qwen3", None, "<think>a</think>b</think>c", "a", "b</think>c"),
    ("qwen3", True, "I should greet them.\n</think>\n\nHello!", "I should greet them.\n", "Hello!"),
    ("qwen3", None, "<", None, "<"),
    ("deepseek_r1", None, "Okay, 3 * 7 = 21.\n</think>\n\nThe answer is **21**.", "Okay, 3 * 7 = 21.\n",
     "The answer is **21**."),
    ("deepseek_r1", None, "<think>\nrepeated start tag</think>answer", "\nrepeated start tag", "answer"),
    ("deepseek_r1", None, "still thinking, never finished <", "still thinking, never finished <", None),
    ("deepseek_r1", False, "plain answer", None, "plain answer"),
]


def _chunkings(text):
    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(len(text))
    for _ in range(20):
        chunks, i = [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            chunks.append(text[i:i + k])
            i += k
        yield chunks


@pytest.mark.parametrize("name,opened,text,reasoning,content", CASES)
def test_complete_and_streaming_parses_agree(name, opened, text, reasoning, content):
    parser = get_reasoning_parser(name, opened)
    assert parser.extract_reasoning(text) == (reasoning, content)
    for chunks in _chunkings(text):
        s = parser.streaming()
        deltas = [s.feed(c) for c in chunks] + [s.finish()]
        assert assemble_reasoning(deltas) == (reasoning, content), chunks
        for d in deltas:
            assert d is None or d.to_openai()  # no empty deltas


def test_opened_by_prompt_and_reasoning_end():
    qwen = get_reasoning_parser("qwen3")
    assert REASONING_PARSERS["qwen3"].opened_by_prompt("<|im_start|>assistant\n<think>\n")
    assert not qwen.opened_by_prompt("<|im_start|>assistant\n")
    assert not qwen.reasoning_ended("<think>\nhmm") and qwen.reasoning_ended("<think>\nhmm</think>")
    assert qwen.reasoning_ended("Plain") and not qwen.reasoning_ended("<thi")
    r1 = get_reasoning_parser("deepseek_r1")
    assert not r1.reasoning_ended("Plain thinking") and r1.reasoning_ended("done</think>{")
    with pytest.raises(ValueError, match="--reasoning-parser.*deepseek_r1"):
        get_reasoning_parser("o1")


def test_reasoning_then_tool_call_streamed_through_both_parsers():
    text = ('<think>\nThe user wants the weather; call the tool.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    reasoning, content = get_reasoning_parser("qwen3").extract_reasoning(text)
    tools = get_tool_parser("hermes").extract_tool_calls(content)
    assert reasoning == "\nThe user wants the weather; call the tool.\n"
    assert tools.content is None and [(c.name, c.arguments) for c in tools.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    for chunks in _chunkings(text):
        rs, ts = get_reasoning_parser("qwen3").streaming(), get_tool_parser("hermes").streaming()
        reasoning_deltas, tool_deltas = [], []
        for piece in chunks + [None]:
            d = rs.feed(piece) if piece is not None else rs.finish()
            if d is not None:
                reasoning_deltas.append(d)
                if d.content is not None:
                    tool_deltas.append(ts.feed(d.content))
        tool_deltas.append(ts.finish())
        assert assemble_reasoning(reasoning_deltas)[0] == reasoning
        got_content, calls = assemble(tool_deltas)
        assert got_content is None
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_weather", '{"city": "Paris"}')]
