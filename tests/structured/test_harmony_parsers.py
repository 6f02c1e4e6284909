"""GPT-OSS's harmony format in the server's parsers: ``--reasoning-parser openai_gptoss`` and ``--tool-call-parser
openai``, on answers written as the model writes them after its chat template's ``<|start|>assistant`` (analysis,
commentary preambles and tool calls with a recipient, before or after the channel, with or without
``<|constrain|>``, final answers; the stop token not in the text), complete and streamed at every split, alone
and chained as the server chains them (ChoiceParser: reasoning first, the tool parser on the content)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("pydantic", reason="the server's dependencies are not installed (the GPU image has none)")

from turnout.entrypoints.openai.chat_tools import ChoiceParser, ToolPlan, keeps_special_tokens, plan_tools  # noqa: E402
from turnout.entrypoints.openai.harmony import split_messages  # noqa: E402
from turnout.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from turnout.entrypoints.openai.reasoning import assemble_reasoning, get_reasoning_parser  # noqa: E402
from turnout.entrypoints.openai.serve_options import ServeOptions  # noqa: E402
from turnout.entrypoints.openai.tool_parsers import assemble, get_tool_parser  # noqa: E402

ANALYSIS = "<|channel|>analysis<|message|>User asks: \"What is 2+2?\" Simple: 4.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**."
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"location":"Tokyo, Japan","unit":"celsius"}')
CALL_HEADER_FIRST = ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
                     '{"tz": "Asia/Tokyo"}')
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking the weather for you.<|end|>"

# (text, reasoning, content, [(name, arguments)]) as the chained parsers give them
CASES = [
    (ANALYSIS + FINAL, 'User asks: "What is 2+2?" Simple: 4.', "2 + 2 = **4**.", []),
    (ANALYSIS + CALL, 'User asks: "What is 2+2?" Simple: 4.', None,
     [("get_weather", '{"location":"Tokyo, Japan","unit":"celsius"}')]),
    # a preamble to the user, then the call with its recipient in the header (one call a turn: <|call|> ends it)
    ("<|channel|>analysis<|message|>Need the time.<|end|>" + PREAMBLE + CALL_HEADER_FIRST + "<|call|>",
     "Need the time.", "Checking the weather for you.", [("get_time", '{"tz": "Asia/Tokyo"}')]),
    # a second round after a tool result: two analysis messages, then the answer
    ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second, with "
     "<b>tags</b> and a < b.<|end|><|start|>assistant<|channel|>final<|message|>Done: {\"a\": 1}",
     "First.\n\nSecond, with <b>tags</b> and a < b.", 'Done: {"a": 1}', []),
    ("<|channel|>final<|message|>No reasoning at all.", None, "No reasoning at all.", []),
    ("Plain text, not harmony <|", None, "Plain text, not harmony <|", []),
    # cut by max_tokens inside the reasoning
    ("<|channel|>analysis<|message|>Thinking about <|start and more", "Thinking about <|start and more", None, []),
    ("<|channel|>final<|message|>Answer.<|return|>", None, "Answer.", []),  # the stop token kept in the text
    # a model not stopped at <|call|> goes on (a made-up tool answer): the turn ended at the call
    (ANALYSIS + CALL + "<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
     '{"temp": 20}<|end|>', 'User asks: "What is 2+2?" Simple: 4.', None,
     [("get_weather", '{"location":"Tokyo, Japan","unit":"celsius"}')]),
]


def _chunkings(text):
    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(len(text))
    for _ in range(10):
        chunks, i = [], 0
        while i < len(text):
            k = rng.randint(1, 9)
            chunks.append(text[i:i + k])
            i += k
        yield chunks


def _plan() -> ToolPlan:
    return ToolPlan(parser=get_tool_parser("openai"))


@pytest.mark.parametrize("text,reasoning,content,calls", CASES)
def test_chained_parsers_complete_and_streamed(text, reasoning, content, calls):
    rp = get_reasoning_parser("openai_gptoss")
    msg, finish = ChoiceParser(rp, _plan()).complete(text, "stop")
    assert msg["reasoning_content"] == reasoning
    assert msg["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == calls
    assert finish == ("tool_calls" if calls else "stop")
    for chunks in _chunkings(text):
        cp = ChoiceParser(rp, _plan())
        deltas = [cp.feed(c) for c in chunks]
        last, stream_finish = cp.finish("", "stop")
        deltas.append(last)
        got_reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
        got_content, got_calls = assemble(deltas)
        assert got_reasoning == reasoning, chunks
        assert (got_content or None) == content, chunks
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls, chunks
        assert stream_finish == finish


@pytest.mark.parametrize("text,reasoning,content,calls", CASES)
def test_each_parser_alone_streams_to_its_complete_parse(text, reasoning, content, calls):
    rp = get_reasoning_parser("openai_gptoss")
    whole = rp.extract_reasoning(text)
    assert whole[0] == reasoning
    tp = get_tool_parser("openai")
    ext = tp.extract_tool_calls(text)  # the raw text, no reasoning parser: analysis is dropped, never content
    assert (ext.content or None) == content
    assert [(c.name, c.arguments) for c in ext.tool_calls] == calls
    for chunks in _chunkings(text):
        s = rp.streaming()
        assert assemble_reasoning([s.feed(c) for c in chunks] + [s.finish()]) == whole, chunks
        t = tp.streaming()
        got_content, got_calls = assemble([t.feed(c) for c in chunks] + [t.finish()])
        assert (got_content or None) == content, chunks
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls, chunks


def test_messages_and_their_headers():
    msgs = split_messages(ANALYSIS + PREAMBLE + CALL + "<|call|>", final=True)
    assert [(m.channel, m.recipient, m.done) for m in msgs] == [
        ("analysis", None, True), ("commentary", None, True), ("commentary", "functions.get_weather", True)]
    # streaming: a header is reported only once complete, a body without a suffix that may begin a marker
    assert split_messages("<|channel|>analy", final=False) == []
    (m,) = split_messages("<|channel|>analysis<|message|>abc<|en", final=False)
    assert m.body == "abc" and not m.done
    rp = get_reasoning_parser("openai_gptoss")
    assert not rp.reasoning_ended(ANALYSIS) and rp.reasoning_ended(ANALYSIS + FINAL)
    assert not rp.opened_by_prompt("<|start|>assistant")


def test_the_server_keeps_the_special_tokens_for_harmony():
    """The channel markers are special tokens: a request parsed as harmony is detokenised with them."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with_tools = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools)
    plain = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    opts = ServeOptions(enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser="openai_gptoss")
    assert keeps_special_tokens(opts, plan_tools(with_tools, opts), structured=False)
    assert keeps_special_tokens(opts, plan_tools(plain, opts), structured=False)  # the reasoning parser's
    assert not keeps_special_tokens(opts, plan_tools(plain, opts), structured=True)  # no reasoning parser then
    hermes = ServeOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    assert not keeps_special_tokens(hermes, plan_tools(with_tools, hermes), structured=False)
