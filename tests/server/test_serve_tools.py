"""Tool calls through a real `turnout serve` (the embedded SmolLM2) with the official openai client:
``tool_choice`` "required" and named (enforced by structured output: the arguments validate against the
tool's schema, jsonschema), "auto" with ``--enable-auto-tool-choice --tool-call-parser hermes`` and a
``--chat-template`` file that shows the 135M model the hermes format once, streamed deltas that assemble to
the non-streamed answer with the same seed, tool conversations in the input, bad tools as 400s naming the
field; and, without a server, the auto and reasoning paths on known text at every streaming split."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("pydantic", reason="the server's dependencies are not installed (the GPU image has none)")

from conftest import ServerProcess  # noqa: E402
from turnout.entrypoints.openai.chat_tools import ChoiceParser, plan_tools, reasoning_parser  # noqa: E402
from turnout.entrypoints.openai.errors import APIError  # noqa: E402
from turnout.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from turnout.entrypoints.openai.serve_options import ServeOptions  # noqa: E402
from turnout.entrypoints.openai.tool_parsers import assemble  # noqa: E402

openai = pytest.importorskip("openai")

jsonschema = pytest.importorskip("jsonschema")

# A hermes-format template (the tools in the system prompt, one worked example), so that greedy SmolLM2
# writes <tool_call> {...} </tool_call> for "auto". Earlier calls are rendered from message.tool_calls.
TEMPLATE = """{%- if tools %}<|im_start|>system
You are a function calling AI model. Here are the available tools: <tools>{% for tool in tools %}\
{{ tool | tojson }}{% endfor %}</tools> For each function call return a JSON object with the function name \
and arguments within <tool_call></tool_call> tags.<|im_end|>
<|im_start|>user
What is the weather in London?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "London", "unit": "c"}}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpl") / "hermes.jinja"
    path.write_text(TEMPLATE)
    s = ServerProcess("--max-model-len", "1024", "--max-num-seqs", "4", "--seed", "0", "--chat-template", str(path),
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--served-model-name", "m")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=180)


def _ask(client, text, **kw):
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], tools=TOOLS,
                                          temperature=kw.pop("temperature", 0), **kw)


def _calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed(client, text, **kw):
    """(content, [(name, arguments)], finish_reason) assembled from the stream's deltas."""
    deltas, finish = [], None
    for chunk in _ask(client, text, stream=True, **kw):
        for c in chunk.choices:
            deltas.append(c.delta.model_dump(exclude_none=True))
            finish = c.finish_reason or finish
    content, calls = assemble(deltas)
    for d in deltas:  # OpenAI's shape: id, type and name come once, in the call's first delta
        for tc in d.get("tool_calls", []):
            assert ("id" in tc) == ("name" in tc.get("function", {})), d
    return content or None, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], finish


def _valid(calls):
    assert calls
    for name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_enforced_choices_validate_streamed_and_not(client, choice):
    # greedy for "required", sampled (same seed for both requests) for the named choice
    text, seed, temperature = (("What is the weather in Paris?", 1, 0) if choice == "required"
                               else ("Add 3 and 4.", 2, 0.8))
    r = _ask(client, text, tool_choice=choice, seed=seed, temperature=temperature)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    calls = _calls_of(ch.message)
    _valid(calls)
    if isinstance(choice, dict):
        assert [n for n, _ in calls] == ["add"]
    assert all(c.id.startswith("call_") and c.type == "function" for c in ch.message.tool_calls)
    assert _streamed(client, text, tool_choice=choice, seed=seed, temperature=temperature) == (
        None, calls, "tool_calls")


def test_parallel_tool_calls_false_is_one_call(client):
    r = _ask(client, "Weather in Paris and in Rome?", tool_choice="required", parallel_tool_calls=False,
             temperature=1.0, seed=7, n=2)
    for ch in r.choices:
        assert len(ch.message.tool_calls) == 1
        _valid(_calls_of(ch.message))


def test_auto_parses_the_models_hermes_calls(client):
    r = _ask(client, "What is the weather in Paris?", seed=3, max_tokens=40)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    calls = _calls_of(ch.message)
    assert [n for n, _ in calls] == ["get_weather"]
    _valid(calls)
    assert _streamed(client, "What is the weather in Paris?", seed=3, max_tokens=40) == (
        ch.message.content, calls, "tool_calls")
    # no call in the text: plain content, finish_reason stop
    r = _ask(client, "Hello, how are you?", seed=3, max_tokens=8)
    assert r.choices[0].message.tool_calls == [] and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    # "none": the tools are in the template, but nothing is parsed as a call
    r = _ask(client, "What is the weather in Paris?", seed=3, tool_choice="none", max_tokens=6)
    assert r.choices[0].message.tool_calls == [] and "<tool_call>" in r.choices[0].message.content


def test_tool_conversation_is_accepted_and_rendered(client, srv):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.tool_calls == []
    # the earlier call reaches the template with its arguments as an object (rendered with tojson)
    toks = httpx.post(f"{srv.base_url}/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(f"{srv.base_url}/detokenize", json={"tokens": toks}).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' in text
    assert "12 degrees, rain" in text


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,param", [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": ""}}], "tool_choice": "none"},
     "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages.0.tool_call_id"),
])
def test_bad_tools_are_400_naming_the_field(srv, body, param):
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------------------------- no server
def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSG, **kw})


def test_auto_needs_the_parser_flags():
    for kw, param in [({"tools": TOOLS}, "tools"), ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice")]:
        with pytest.raises(APIError) as e:
            plan_tools(_req(**kw), ServeOptions())
        assert e.value.status == 400 and e.value.param == param and "--enable-auto-tool-choice" in e.value.message
    assert plan_tools(_req(tools=TOOLS, tool_choice="none"), ServeOptions()).parser is None
    assert plan_tools(_req(tools=TOOLS, tool_choice="required"), ServeOptions()).constraint is not None
    # mistral's [TOOL_CALLS] is a special token: kept in the text for its parser
    mistral = ServeOptions(enable_auto_tool_choice=True, tool_call_parser="mistral")
    assert plan_tools(_req(tools=TOOLS), mistral).keep_special_tokens
    assert not plan_tools(_req(tools=TOOLS, tool_choice="required"), mistral).keep_special_tokens


def _every_split(parser_factory, text):
    """The complete answer, and the stream's assembly for every split of the text into two deltas (and one
    delta per character)."""
    whole = parser_factory().complete(text, "stop")
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        p, deltas = parser_factory(), []
        for piece in pieces[:-1]:
            deltas.append(p.feed(piece))
        last, finish = p.finish(pieces[-1], "stop")
        deltas.append(last)
        content, calls = assemble(deltas)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
        msg, reason = whole
        assert (content or None, reasoning, finish) == (msg["content"] or None, msg["reasoning_content"], reason)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    return whole


def test_auto_path_on_known_text_streamed_equals_complete():
    opts = ServeOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    plan = plan_tools(_req(tools=TOOLS), opts)
    text = ('<think>The user wants weather.</think>\nSure.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, '
            '"b": 2}}</tool_call>')
    msg, reason = _every_split(lambda: ChoiceParser(reasoning_parser(opts, "", plan, False), plan), text)
    assert reason == "tool_calls" and msg["reasoning_content"] == "The user wants weather." and msg["content"] == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    # parallel_tool_calls false: only the first call, streamed and not
    plan1 = plan_tools(_req(tools=TOOLS, parallel_tool_calls=False), opts)
    msg, _ = _every_split(lambda: ChoiceParser(None, plan1), text)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]


def test_reasoning_opened_by_the_prompt():
    opts = ServeOptions(reasoning_parser="qwen3")
    plan = plan_tools(_req(), opts)
    text = "  I should greet back.\n</think>\n\nHello!"
    msg, reason = _every_split(lambda: ChoiceParser(reasoning_parser(opts, "<|im_start|>assistant\n<think>\n", plan,
                                                                     False), plan), text)
    assert (msg["reasoning_content"].strip(), msg["content"], reason) == ("I should greet back.", "Hello!", "stop")
    # not opened by the prompt (qwen3's hybrid models): no <think> in the output, all content
    msg, _ = _every_split(lambda: ChoiceParser(reasoning_parser(opts, "assistant\n", plan, False), plan), "Hello!")
    assert (msg["reasoning_content"], msg["content"]) == (None, "Hello!")
    # under a structured-output constraint the grammar holds from the first token: no reasoning split
    assert reasoning_parser(opts, "<think>\n", plan, True) is None
