"""Tool-call parsers on model-shaped outputs: the complete parse, and streams split at every character
boundary (one character at a time, every two-piece split, random chunks) that must assemble to exactly
the complete parse. Then tool_choice "required" / named enforced by structured output: constrained random
walks with the SmolLM2 tokenizer whose parsed calls carry arguments valid for the tool's schema.
"""

from __future__ import annotations

import json
import random

import pytest

from structured_helpers import check_schema, constrained_walk
from turnout.entrypoints.openai.tool_parsers import TOOL_PARSERS, assemble, get_tool_parser
from turnout.entrypoints.openai.tool_parsers.constrained import constrained_tool_parser, structured_outputs_for_tools
from turnout.structured import StructuredOutputsError

# (text, expected content, expected [(name, arguments)])
HERMES = [
    ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", '
     '"unit": "celsius"}}\n</tool_call>', None,
     [("get_current_temperature", '{"location": "San Francisco, CA, USA", "unit": "celsius"}')]),
    ('Let me check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "T\\u014dky\\u014d \\"East\\" {x} </tool_call>", '
     '"days": [1, 2]}}\n</tool_call>', "Let me check both cities.",
     [("get_weather", '{"city": "Paris"}'),
      ("get_weather", '{"city": "T\\u014dky\\u014d \\"East\\" {x} </tool_call>", "days": [1, 2]}')]),
    ('<tool_call>\n{"name": "search", "arguments": {"query": "llm", "filters": {"year": 2024, "score": -1.5e3, '
     '"ok": true, "none": null}}}\n</tool_call>', None,
     [("search", '{"query": "llm", "filters": {"year": 2024, "score": -1.5e3, "ok": true, "none": null}}')]),
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),
    ('<tool_call>\n{\n  "name": "create_event",\n  "arguments": {\n    "title": "Sync",\n    "attendees": ["a@x.io"]\n  }\n}'
     '\n</tool_call>\n', None,
     [("create_event", '{\n    "title": "Sync",\n    "attendees": ["a@x.io"]\n  }')]),  # pretty-printed
    ('<tool_call>\n{"name": "no_args"}\n</tool_call>', None, [("no_args", "{}")]),
    ('<tool_call>\n{"name": "f", "arguments": {}}', None, [("f", "{}")]),  # stopped before </tool_call>
    ("The weather in Paris is sunny. Use <b>tags</b> freely, compare a < b and <tool", None, []),
    ("  Plain answer with trailing space  ", None, []),
]
LLAMA3 = [
    ('{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
     None, [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, {"y": "};{"}]}}', None,
     [("a", "{}"), ("b", '{"x": [1, {"y": "};{"}]}')]),
    (' {"name": "f", "arguments": {"q": "x"}}\n', None, [("f", '{"q": "x"}')]),
    ("Hello! How can I help you today?", None, []),
    ('{"answer": 42}', None, []),  # JSON, but not a call: content
]
MISTRAL = [
    ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]',
     None, [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')]),
    ('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', None,
     [("a", '{"x": 1}'), ("b", "{}")]),
    ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris [ARGS]"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}', "Sure.",
     [("get_weather", '{"city": "Paris [ARGS]"}'), ("get_time", '{"tz": "CET"}')]),
    ("No tools needed [here], [TOOL", None, []),
]
CASES = [("hermes", *c) for c in HERMES] + [("llama3_json", *c) for c in LLAMA3] + [("mistral", *c) for c in MISTRAL]
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing </tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1'),  # cut by max_tokens
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and then some words'),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}'),
    ("mistral", "[TOOL_CALLS]get_weather"),
]


def _stream(parser, chunks):
    s = parser.streaming()
    deltas = [s.feed(c) for c in chunks] + [s.finish()]
    return deltas, assemble(deltas)


def _check_stream(parser, text, chunks, want_content, want_calls):
    deltas, (content, calls) = _stream(parser, chunks)
    assert content == (want_content if want_calls else (text or None)), chunks
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == want_calls, chunks
    # OpenAI's delta shape: the first delta of a call has its index, id, type and name; later ones only
    # arguments; no name twice.
    seen = set()
    for d in deltas:
        for tc in (d.tool_calls if d else []):
            if tc["index"] in seen:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                assert tc["function"]["arguments"]
            else:
                assert tc["index"] == len(seen) and tc["id"] and tc["type"] == "function" and tc["function"]["name"]
                seen.add(tc["index"])
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=lambda v: v if isinstance(v, str) and len(v) < 12
                         else None)
def test_complete_and_streaming_parses_agree(name, text, content, calls):
    parser = get_tool_parser(name)
    got = parser.extract_tool_calls(text)
    assert got.tools_called == bool(calls)
    assert [(c.name, c.arguments) for c in got.tool_calls] == calls
    assert got.content == (content if calls else text)
    for c in got.tool_calls:
        assert isinstance(json.loads(c.arguments), dict) and c.id
        assert c.to_openai()["function"] == {"name": c.name, "arguments": c.arguments}
    _check_stream(parser, text, list(text), content, calls)  # one character at a time: every boundary
    for cut in range(len(text) + 1):  # every two-piece split
        _check_stream(parser, text, [text[:cut], text[cut:]], content, calls)
    rng = random.Random(len(text))
    for _ in range(20):
        chunks, i = [], 0
        while i < len(text):
            k = rng.randint(1, 7)
            chunks.append(text[i:i + k])
            i += k
        _check_stream(parser, text, chunks, content, calls)


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_calls_are_content(name, text):
    got = get_tool_parser(name).extract_tool_calls(text)
    assert not got.tools_called and got.tool_calls == [] and got.content == text


def test_mistral_ids_and_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "openai"}
    calls = get_tool_parser("mistral").extract_tool_calls(MISTRAL[1][0]).tool_calls
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    with pytest.raises(ValueError, match="--tool-call-parser.*hermes"):
        get_tool_parser("qwen")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: any object
TOOLS = [WEATHER, ADD, NOW]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}


def test_required_tool_choice_walks_give_valid_calls(tok, compiler, walk_tools):
    params = structured_outputs_for_tools(TOOLS, "required")
    texts = constrained_walk(tok, compiler, walk_tools, [params] * 6, seed=3, max_steps=600)
    parser = constrained_tool_parser("required")
    names = set()
    for text in texts:
        got = parser.extract_tool_calls(text)
        assert got.tools_called and got.content is None, text
        for call in got.tool_calls:
            check_schema(json.loads(call.arguments), SCHEMAS[call.name])
            names.add(call.name)
        _check_stream(parser, text, list(text), None, [(c.name, c.arguments) for c in got.tool_calls])
    assert len(names) >= 2  # the walks reach several tools


def test_required_single_call_when_parallel_is_off(tok, compiler, walk_tools):
    params = structured_outputs_for_tools([ADD], "required", parallel_tool_calls=False)
    for text in constrained_walk(tok, compiler, walk_tools, [params] * 3, seed=4, max_steps=600):
        assert len(constrained_tool_parser("required").extract_tool_calls(text).tool_calls) == 1


def test_named_tool_choice_walks_give_valid_arguments(tok, compiler, walk_tools):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    params = structured_outputs_for_tools(TOOLS, choice)
    parser = constrained_tool_parser(choice)
    for text in constrained_walk(tok, compiler, walk_tools, [params] * 4, seed=5):
        got = parser.extract_tool_calls(text)
        assert [c.name for c in got.tool_calls] == ["get_weather"]
        check_schema(json.loads(got.tool_calls[0].arguments), SCHEMAS["get_weather"])
        _check_stream(parser, text, list(text), None, [(c.name, c.arguments) for c in got.tool_calls])


def test_auto_and_none_enforce_nothing():
    assert structured_outputs_for_tools(TOOLS, "auto") is None
    assert structured_outputs_for_tools(TOOLS, "none") is None
    assert structured_outputs_for_tools(None, None) is None
    assert constrained_tool_parser("auto") is None


@pytest.mark.parametrize("tools,choice,field", [
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice.function.name"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {}}, "tool_choice.function.name"),
    ([], "required", "tools"),
    (None, "required", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "required",
     "tools[0].function.parameters"),
    ([WEATHER, {"type": "function", "function": {"description": "no name"}}], "auto", "tools[1].function.name"),
    ([WEATHER, WEATHER], "required", "tools[1].function.name"),
    ([{"type": "retrieval"}], "required", "tools[0].type"),
    ("get_weather", "required", "tools"),
])
def test_tool_errors_name_the_field(tools, choice, field):
    with pytest.raises(StructuredOutputsError) as e:
        structured_outputs_for_tools(tools, choice)
    assert e.value.field == field, str(e.value)
