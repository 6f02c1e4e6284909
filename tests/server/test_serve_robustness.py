"""Bad clients against the real server: every mistake is a 4xx naming the field, never a 500, and the
server keeps answering; disconnects free everything within a step."""

from __future__ import annotations

import re
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def post(server, path, body=None, content=None, headers=None, timeout=60):
    return httpx.post(f"{server.base_url}{path}", json=body, content=content, timeout=timeout,
                      headers=headers or ({"content-type": "application/json"} if content is not None else None))


def assert_error(r, status, param=None, code=None, contains=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if contains is not None:
        assert contains in err["message"], err
    return err


def still_ok(server):
    r = post(server, COMP, {"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text


BAD_REQUESTS = [
    # (path, raw body or json, status, param)
    (COMP, b"{not json", 400, None),
    (COMP, b"", 400, None),
    (COMP, b"[1, 2]", 400, None),
    (COMP, b"\xff\xfe", 400, None),
    (COMP, {}, 400, "prompt"),
    (COMP, {"prompt": 5}, 400, "prompt"),
    (COMP, {"prompt": ""}, 400, "prompt"),
    (COMP, {"prompt": []}, 400, "prompt"),
    (COMP, {"prompt": [[]]}, 400, "prompt"),
    (COMP, {"prompt": [10**12]}, 400, "prompt"),
    (COMP, {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (COMP, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (COMP, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (COMP, {"prompt": "x", "top_k": -3}, 400, "top_k"),
    (COMP, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (COMP, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMP, {"prompt": "x", "frequency_penalty": -9}, 400, "frequency_penalty"),
    (COMP, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMP, {"prompt": "x", "seed": "abc"}, 400, "seed"),
    (COMP, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    (COMP, {"prompt": "x", "n": 0}, 400, "n"),
    (COMP, {"prompt": "x", "n": 100000}, 400, "n"),
    (COMP, {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    (COMP, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (COMP, {"prompt": "x", "stop": ["a"] * 50}, 400, "stop"),
    (COMP, {"prompt": "x", "stop": 7}, 400, "stop"),
    (COMP, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (COMP, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (COMP, {"prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    (COMP, {"prompt": ["a"] * 1000}, 400, "prompt"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages.0.content"),
    (CHAT, {"messages": MSGS, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CHAT, {"messages": MSGS, "guided_regex": "("}, 400, "guided_regex"),
    (CHAT, {"messages": MSGS, "temperature": float("nan")}, 400, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{p.rsplit('/', 1)[1]}-{param}" for i, (p, _, _, param) in enumerate(BAD_REQUESTS)])
def test_bad_request_is_4xx_naming_the_field(server, path, body, status, param):
    if isinstance(body, bytes):
        r = post(server, path, content=body)
    elif isinstance(body, dict) and any(isinstance(v, float) and v != v for v in body.values()):
        r = post(server, path, content=b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}')
    else:
        r = post(server, path, body)
    assert_error(r, status, param)


def test_server_still_answers_after_rejections(server):
    still_ok(server)


def test_unknown_model_is_404(server):
    assert_error(post(server, CHAT, {"model": "gpt-17", "messages": MSGS}), 404, "model", "model_not_found")


def test_context_length_exceeded_names_the_numbers(server):
    long_prompt = "hello " * 800  # > 512 tokens
    err = assert_error(post(server, COMP, {"prompt": long_prompt}), 400, "prompt", "context_length_exceeded")
    assert "512" in err["message"] and re.search(r"\b8\d\d\b", err["message"])
    err = assert_error(post(server, COMP, {"prompt": "hello", "max_tokens": 600}), 400, "max_tokens",
                       "context_length_exceeded")
    assert "512" in err["message"] and "600" in err["message"]
    err = assert_error(post(server, CHAT, {"messages": MSGS, "max_completion_tokens": 10_000}), 400,
                       "max_completion_tokens", "context_length_exceeded")
    still_ok(server)


def test_oversized_body_is_413(server):
    r = post(server, COMP, {"prompt": "x" * (5 << 20)})
    assert_error(r, 413, code="request_too_large")
    still_ok(server)


def test_unknown_route_and_method_are_openai_shaped(server):
    assert_error(httpx.get(f"{server.base_url}/v1/nothing"), 404)
    assert_error(httpx.get(f"{server.base_url}{COMP}"), 405)


# ---------------------------------------------------------------------------------------------- disconnects
def gauges(server) -> dict:
    text = httpx.get(f"{server.base_url}/metrics").text
    vals = dict(re.findall(r"^(turnout_[a-z_]+(?:\{[^}]*\})?) ([0-9.eE+-]+)$", text, re.M))
    return {k: float(v) for k, v in vals.items()}


def wait_idle(server, timeout=10.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        g = gauges(server)
        if (g["turnout_num_requests_running"] == 0 and g["turnout_num_requests_waiting"] == 0
                and g["turnout_num_requests_in_flight"] == 0 and g["turnout_kv_cache_usage_perc"] == 0):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"server not idle after {timeout}s: {gauges(server)}")


def aborted(server) -> float:
    return gauges(server).get('turnout_request_finished_total{finished_reason="abort"}', 0.0)


LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


def test_disconnect_mid_stream_frees_everything(server):
    wait_idle(server)
    before = aborted(server)
    with httpx.stream("POST", f"{server.base_url}{COMP}", json={"prompt": "Count: 1, 2,", "stream": True, **LONG},
                      timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got >= 3:
                break
    # 400 tokens would take far longer than this: it was aborted, not finished
    assert wait_idle(server, timeout=5) < 5
    assert aborted(server) == before + 1
    still_ok(server)


def test_disconnect_before_first_token(server):
    wait_idle(server)
    before = aborted(server)
    # a long prompt: the client is gone before prefill ends
    body = {"prompt": "word " * 450, "stream": True, "max_tokens": 50, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}{COMP}", json=body, timeout=60) as r:
        assert r.status_code == 200
    wait_idle(server, timeout=10)
    assert aborted(server) == before + 1


def test_disconnect_non_streaming(server):
    wait_idle(server)
    before = aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        post(server, CHAT, {"messages": MSGS, **LONG}, timeout=1.0)
    assert wait_idle(server, timeout=5) < 5
    assert aborted(server) == before + 1
    still_ok(server)
