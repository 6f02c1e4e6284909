"""`turnout serve --async-scheduling` (the GPU default, forced on here on CPU) answers exactly as the
synchronous session server does: concurrent greedy and seeded requests, stop strings, streaming."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")

from conftest import MAIN_SERVER_ARGS, ServerProcess  # noqa: E402

PROMPTS = ["Name three colours.", "What is 2 + 2?", "Write a haiku about rain.", "Say hello in French."]


@pytest.fixture(scope="module")
def async_server():
    srv = ServerProcess(*MAIN_SERVER_ARGS, "--async-scheduling")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def _ask(base_url, model, i, prompt, stream):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=24 + 4 * i,
              temperature=0.0 if i % 2 == 0 else 0.9, seed=100 + i, stop=["\n\n"] if i == 2 else None)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _all(base_url, model, stream):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: one batch in the engine
        return list(pool.map(lambda a: _ask(base_url, model, *a, stream), enumerate(PROMPTS)))


@pytest.mark.parametrize("stream", [False, True])
def test_async_scheduling_server_answers_as_the_synchronous_one(server, async_server, model_name, stream):
    want = _all(server.base_url, model_name, stream)
    got = _all(async_server.base_url, model_name, stream)
    assert got == want
    assert all(text for text, _ in got)

    def lookahead_steps(srv):
        line = [ln for ln in httpx.get(f"{srv.base_url}/metrics").text.splitlines()
                if ln.startswith("turnout_lookahead_steps_total")]
        return float(line[0].split()[-1])

    assert lookahead_steps(async_server) > 0, "the async server never launched a step ahead"
    assert lookahead_steps(server) == 0
