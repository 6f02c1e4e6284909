"""The real `turnout serve` (default model) driven by the official openai client."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_health_version_metrics(server, model_name):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    models = httpx.get(f"{server.base_url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 512
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("turnout_num_requests_running", "turnout_num_requests_waiting", "turnout_kv_cache_usage_perc",
                 "turnout_num_preemptions_total", "turnout_prompt_tokens_total", "turnout_generation_tokens_total",
                 "turnout_time_to_first_token_seconds_bucket", "turnout_inter_token_latency_seconds_bucket",
                 "turnout_e2e_request_latency_seconds_bucket", 'turnout_op_implementation{impl="'):
        assert name in text, name
    assert 'op="paged_attention"' in text


def test_completion(client, model_name):
    r = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=5,
                                  temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length" and c.text
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    # greedy is deterministic
    again = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=5,
                                      temperature=0)
    assert again.choices[0].text == c.text


def test_chat_completion_with_logprobs(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSGS, max_tokens=4, temperature=0.7, seed=1,
                                       logprobs=True, top_logprobs=2)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert len(c.logprobs.content) == r.usage.completion_tokens == 4
    for tok in c.logprobs.content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 2
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob


def _stream_completion(client, model_name, **kw):
    text, tokens, finish, usage = "", 0, [], None
    for chunk in client.completions.create(model=model_name, stream=True, logprobs=0,
                                           stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            tokens += len(c.logprobs.tokens) if c.logprobs else 0
            if c.finish_reason:
                finish.append(c.finish_reason)
    return text, tokens, finish, usage


def test_streamed_completion_equals_non_streamed(client, model_name):
    kw = dict(prompt="Once upon a time", max_tokens=8, temperature=0.9, seed=1234)
    text, tokens, finish, usage = _stream_completion(client, model_name, **kw)
    ref = client.completions.create(model=model_name, **kw)
    assert text == ref.choices[0].text
    assert finish == [ref.choices[0].finish_reason]
    assert tokens == usage.completion_tokens == ref.usage.completion_tokens
    assert usage.prompt_tokens == ref.usage.prompt_tokens


def test_streamed_chat_equals_non_streamed(client, model_name):
    kw = dict(messages=MSGS, max_tokens=8, temperature=0.8, seed=7)
    chunks = list(client.chat.completions.create(model=model_name, stream=True, logprobs=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ntok = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    ref = client.chat.completions.create(model=model_name, **kw)
    assert text == ref.choices[0].message.content
    assert finishes == [ref.choices[0].finish_reason]
    assert ntok == usage.completion_tokens == ref.usage.completion_tokens


def test_n_and_stop_and_echo(client, model_name):
    r = client.completions.create(model=model_name, prompt="1, 2, 3,", max_tokens=6, n=2, temperature=1.0,
                                  seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    greedy = client.completions.create(model=model_name, prompt="1, 2, 3,", max_tokens=8, temperature=0)
    full = greedy.choices[0].text
    stop = full.strip()[:2] if len(full.strip()) >= 2 else full.strip()
    if stop:  # stop at the first occurrence of something the model is known to say
        s = client.completions.create(model=model_name, prompt="1, 2, 3,", max_tokens=8, temperature=0, stop=[stop])
        assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].text
        streamed, _, finish, _ = _stream_completion(client, model_name, prompt="1, 2, 3,", max_tokens=8,
                                                    temperature=0, stop=[stop])
        assert streamed == s.choices[0].text and finish == ["stop"]
    e = client.completions.create(model=model_name, prompt="Hello", max_tokens=2, temperature=0, echo=True)
    assert e.choices[0].text.startswith("Hello")


def test_sampling_options_accepted(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=MSGS, max_completion_tokens=3, temperature=0.5, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_completion_logprobs_shape(client, model_name):
    r = client.completions.create(model=model_name, prompt="Hi", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert all(len(t) >= 1 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
