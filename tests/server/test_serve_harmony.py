"""GPT-OSS's harmony answers through the server's chat endpoint (the real app over HTTP, the official openai client)
with ``--reasoning-parser openai_gptoss --enable-auto-tool-choice --tool-call-parser openai``.

No GPT-OSS tokenizer or chat template is available offline, and a tiny random model writes no harmony, so the
engine here is the fake one (tests/server/serve_fakes.py) answering a scripted harmony text, token by token, whose
channel markers are *special tokens* of its tokenizer: decoded with ``skip_special_tokens`` they vanish, as with
the real tokenizer. So these tests also hold the server to keeping the special tokens for these parsers. The
model side (GptOssForCausalLM against transformers) is tests/models/test_gpt_oss_vs_hf.py.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the openai client is not installed (the GPU image has none)")

from serve_fakes import FakeEngine, FakeTokenizer  # noqa: E402
from turnout.entrypoints.openai.harmony import MARKERS  # noqa: E402

PIECES = [*MARKERS, "assistant", "analysis", "commentary", "final", " to=functions.get_weather", "json", " ",
          "The user wants", " the weather.", '{"city":', ' "Paris"}', "It is", " sunny."]
SPECIAL = set(MARKERS)
REASONING = "The user wants the weather."


def _script(*parts: str) -> list[int]:
    return [256 + PIECES.index(p) for p in parts]


CALL = _script("<|channel|>", "analysis", "<|message|>", "The user wants", " the weather.", "<|end|>", "<|start|>",
               "assistant", "<|channel|>", "commentary", " to=functions.get_weather", " ", "<|constrain|>", "json",
               "<|message|>", '{"city":', ' "Paris"}')  # then <|call|>, the stop token, not in the text
ANSWER = _script("<|channel|>", "analysis", "<|message|>", "The user wants", " the weather.", "<|end|>", "<|start|>",
                 "assistant", "<|channel|>", "final", "<|message|>", "It is", " sunny.")


class HarmonyTokenizer(FakeTokenizer):
    """Bytes for the prompt, one id per piece above for the answer; the markers are special tokens."""

    def decode(self, ids, skip_special_tokens=True):
        out = []
        for i in ids:
            if i >= 256:
                piece = PIECES[i - 256]
                if not (skip_special_tokens and piece in SPECIAL):
                    out.append(piece)
            elif 2 <= i < 256:
                out.append(chr(i))
        return "".join(out)

    def __len__(self):
        return 256 + len(PIECES)


class HarmonyEngine(FakeEngine):
    """Answers ``CALL`` when the request has tools, ``ANSWER`` otherwise, then stops as on the stop token;
    detokenises as the request asks (``skip_special_tokens``)."""

    def __init__(self):
        super().__init__(max_model_len=512, step_delay=0.001)
        self.tokenizer = HarmonyTokenizer()
        self.scripts: dict[str, list[int]] = {}
        self.skip_seen: list[bool] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, **template_kwargs):
        ids = super().apply_chat_template(messages, add_generation_prompt)
        return ids + ([ord("T")] if template_kwargs.get("tools") else [])  # marks a request with tools

    def add_request(self, request_id, prompt, params, arrival_time=None):
        super().add_request(request_id, prompt, params, arrival_time)
        self.scripts[request_id] = CALL if prompt[-1] == ord("T") else ANSWER
        self.skip_seen.append(params.skip_special_tokens)

    def step(self):
        self.steps += 1
        outputs = []
        while self.waiting:
            rid = next(iter(self.waiting))
            self.running[rid] = self.waiting.pop(rid)
        from turnout.engine.outputs import CompletionOutput, RequestOutput

        for rid, r in list(self.running.items()):
            script, toks = self.scripts[rid], r.outs[0]
            toks.append(script[len(toks)])
            done = len(toks) == len(script)
            text = self.tokenizer.decode(toks, skip_special_tokens=r.params.skip_special_tokens)
            outputs.append(RequestOutput(rid, None, r.prompt_ids, [CompletionOutput(
                0, text, list(toks), None, None, "stop" if done else None, None)], done))
            if done:
                del self.running[rid]
        return outputs


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.fixture
def client_and_engine(fake_server):
    from turnout.entrypoints.openai.serve_options import ServeOptions

    engine = HarmonyEngine()
    options = ServeOptions(enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser="openai_gptoss")
    with fake_server(engine=engine, options=options) as srv:
        yield openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=30), engine


def _ask(client, tools, **kw):
    return client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Paris?"}],
                                          max_tokens=64, **({"tools": tools} if tools else {}), **kw)


def _streamed(client, tools):
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in _ask(client, tools, stream=True):
        for c in chunk.choices:
            d = c.delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, ["", ""])
                slot[0] += tc.function.name or ""
                slot[1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return reasoning, content, [tuple(v) for _, v in sorted(calls.items())], finish


def test_a_harmony_tool_call_through_the_server(client_and_engine):
    client, engine = client_and_engine
    r = _ask(client, [WEATHER])
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.model_extra["reasoning_content"] == REASONING
    assert ch.message.content is None
    assert [(c.function.name, c.function.arguments) for c in ch.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert _streamed(client, [WEATHER]) == (REASONING, "", [("get_weather", '{"city": "Paris"}')], "tool_calls")
    assert engine.skip_seen == [False, False]  # the markers are special tokens: kept for the parsers


def test_a_harmony_answer_through_the_server(client_and_engine):
    client, engine = client_and_engine
    ch = _ask(client, None).choices[0]
    assert (ch.message.model_extra["reasoning_content"], ch.message.content, ch.finish_reason) == (
        REASONING, "It is sunny.", "stop")
    assert not ch.message.tool_calls
    assert _streamed(client, None) == (REASONING, "It is sunny.", [], "stop")
    # a client that asks for the special tokens to be skipped gets what it asked for: no markers, no channels
    ch = _ask(client, None, extra_body={"skip_special_tokens": True}).choices[0]
    assert engine.skip_seen == [False, False, True]
    assert ch.message.content == "analysisThe user wants the weather.assistantfinalIt is sunny."
