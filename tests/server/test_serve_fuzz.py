"""A fuzzer against ONE real `turnout serve` (the embedded model on 127.0.0.1): thousands of random and
boundary request bodies on /v1/completions and /v1/chat/completions.

Property, for every body: never a 5xx (a stream's in-band error included), every 4xx OpenAI-shaped
(``{"error": {"message", "type", "param", "code"}}``) and naming what was wrong (``param``, or a field /
the body in the message), every 2xx a well-formed answer; the engine stays alive throughout (checked every
``HEALTH_EVERY`` bodies) and answers a normal request at the end.

Bodies: huge and negative integers in every numeric field (int32 / int64 / 64-bit edges, 10**30), NaN
and infinities (raw ``NaN`` / ``Infinity`` JSON tokens: ``json.dumps`` writes them), wrong types, long and
odd strings, deep nesting, token-id prompts at and past the vocabulary boundary, raw bytes. Valid
generations are kept cheap by the server's limits (``--max-model-len``, ``--max-tokens-per-request``).

CI runs ``TURNOUT_FUZZ_EXAMPLES`` bodies per endpoint (default 500); set it higher for a long run, e.g.
``TURNOUT_FUZZ_EXAMPLES=20000 pytest -s tests/server/test_serve_fuzz.py``; ``TURNOUT_FUZZ_SEED=N`` draws
other bodies than CI's fixed ones. The counts are printed and, with ``TURNOUT_FUZZ_REPORT=path``, written
there as JSON (with which field each 4xx named).
"""

from __future__ import annotations

import collections
import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from conftest import ServerProcess

EXAMPLES = int(os.environ.get("TURNOUT_FUZZ_EXAMPLES", "500"))
REPORT = os.environ.get("TURNOUT_FUZZ_REPORT")
SEED = os.environ.get("TURNOUT_FUZZ_SEED")  # unset: the same bodies every run (CI); set: other bodies
HEALTH_EVERY = 100
VOCAB = 49152  # SmolLM2-135M
MAX_MODEL_LEN = 64
SERVER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--max-queue", "64",
               "--max-tokens-per-request", "256", "--seed", "0")
COMP, CHAT = "/v1/completions", "/v1/chat/completions"
COUNTS: collections.Counter = collections.Counter()
SECONDS: collections.Counter = collections.Counter()  # time spent per status class
SLOWEST: list[tuple[float, str]] = []
PARAMS: collections.Counter = collections.Counter()  # which field each 4xx named
FAILURES: list[str] = []


@pytest.fixture(scope="module")
def srv():
    s = ServerProcess(*SERVER_ARGS)
    try:
        s.wait_healthy()
        with httpx.Client(base_url=s.base_url, timeout=120) as client:
            s.client = client
            s.model = client.get("/v1/models").json()["data"][0]["id"]
            yield s
    finally:
        s.stop()
        _report()


def _report():
    if not COUNTS:
        return
    line = " ".join(f"{k}={v}" for k, v in sorted(COUNTS.items()))
    print(f"\nfuzz counts: {line}; seconds: " + " ".join(f"{k}={v:.1f}" for k, v in sorted(SECONDS.items())))
    for took, what in SLOWEST:
        print(f"  slowest {took:.2f}s: {what}")
    if REPORT:
        with open(REPORT, "w") as f:
            json.dump({"counts": dict(COUNTS), "seconds": dict(SECONDS), "errors_by_param": dict(PARAMS.most_common()),
                       "failures": FAILURES[:50]}, f, indent=1)


# ------------------------------------------------------------------------------------------ strategies
EDGE_INTS = [0, 1, -1, 2, 3, 20, 21, 127, 128, 129, VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1, 2**31, -(2**31),
             -(2**31) - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**30,
             -(10**30), 1180591620717411303424]
edge_int = st.sampled_from(EDGE_INTS)
any_int = st.one_of(edge_int, st.integers(), st.integers(-3, 70))
odd_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
    [float("nan"), float("inf"), float("-inf"), -0.0, 1e-320, 1e308, -1e308, 0.5, 1.0, 2.0, 100.0, 100.5]))
odd_text = st.one_of(st.text(max_size=40), st.sampled_from(
    ["", " ", "\x00", "\u202e", "\U0001f600" * 50, "<|im_end|>", "<|endoftext|>", "a" * 5000,
     "\\u0000", "null", "NaN", "1", "-1"]))
wrong = st.one_of(st.none(), st.booleans(), odd_text, st.lists(st.integers(-2, 2), max_size=3),
                  st.dictionaries(st.text(max_size=5), st.integers(), max_size=2), odd_float)


def numeric(valid):
    """A numeric field: mostly edges and wrong types, sometimes a cheap valid value."""
    return st.one_of(valid, any_int, odd_float, wrong)


token_id = st.one_of(st.integers(0, VOCAB - 1), edge_int, st.integers())
token_ids = st.lists(token_id, min_size=0, max_size=6)
small_bool = st.one_of(st.booleans(), wrong)
stop = st.one_of(odd_text, st.lists(odd_text, max_size=20), wrong)
logit_bias = st.one_of(st.dictionaries(st.one_of(st.integers().map(str), odd_text), st.one_of(odd_float, any_int),
                                       max_size=3), wrong)
stream_options = st.one_of(st.fixed_dictionaries({}, optional={"include_usage": small_bool,
                                                               "continuous_usage_stats": small_bool}), wrong)

SAMPLING = {
    "model": st.one_of(st.just("SmolLM2-135M-Instruct"), odd_text, wrong),
    "n": numeric(st.integers(1, 3)),
    "temperature": numeric(st.floats(0, 2)),
    "top_p": numeric(st.floats(0.01, 1)),
    "top_k": numeric(st.one_of(st.integers(-1, 50), st.just(VOCAB), st.just(2**31 - 1))),
    "min_p": numeric(st.floats(0, 1)),
    "presence_penalty": numeric(st.floats(-2, 2)),
    "frequency_penalty": numeric(st.floats(-2, 2)),
    "repetition_penalty": numeric(st.floats(0.5, 2)),
    "seed": numeric(st.integers(-(2**63), 2**64 - 1)),
    "stop": stop,
    "stop_token_ids": st.one_of(token_ids, wrong),
    "stream": small_bool,
    "stream_options": stream_options,
    "ignore_eos": small_bool,
    "min_tokens": numeric(st.integers(0, 3)),
    "skip_special_tokens": small_bool,
    "include_stop_str_in_output": small_bool,
    "logit_bias": logit_bias,
    "user": st.one_of(odd_text, wrong),
}
# Always present (an absent max_tokens means 16 tokens, or the whole context in chat): 2xx stay cheap.
MAX_TOKENS = {"max_tokens": numeric(st.integers(1, 3))}

prompt = st.one_of(odd_text, token_ids, st.lists(token_ids, max_size=3), st.lists(odd_text, max_size=3),
                   st.lists(st.one_of(odd_text, token_id), max_size=3), wrong)
completion_body = st.fixed_dictionaries({"prompt": prompt, **MAX_TOKENS}, optional={
    **SAMPLING, "logprobs": numeric(st.integers(0, 5)), "echo": small_bool, "suffix": st.one_of(odd_text, wrong),
    "best_of": numeric(st.integers(1, 3))})

content = st.one_of(odd_text, st.none(), st.lists(st.fixed_dictionaries(
    {"type": st.one_of(st.just("text"), odd_text), "text": st.one_of(odd_text, wrong)}), max_size=2), wrong)
role = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), odd_text, wrong)
message = st.one_of(st.fixed_dictionaries({"role": role, "content": content},
                                          optional={"name": st.one_of(odd_text, wrong),
                                                    "tool_calls": wrong, "tool_call_id": wrong}), wrong)
chat_body = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, min_size=0, max_size=3), wrong),
                                   **MAX_TOKENS}, optional={
    **SAMPLING, "max_completion_tokens": numeric(st.integers(1, 3)), "logprobs": small_bool,
    "top_logprobs": numeric(st.integers(0, 5)), "tools": st.one_of(st.lists(wrong, max_size=2), wrong),
    "tool_choice": st.one_of(st.just("none"), wrong), "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["text", "json_object"]), odd_text)}), wrong),
    "add_generation_prompt": small_bool})


# Valid bodies at the edges of what validation admits: the class of the killer requests (they
# passed validation, then overflowed a tensor inside a step). One or two tokens each, so they stay cheap.
edge_token = st.one_of(st.sampled_from([0, 1, 2, VOCAB - 2, VOCAB - 1]), st.integers(0, VOCAB - 1))
VALID_SAMPLING = {
    "n": st.integers(1, 2),
    "temperature": st.sampled_from([0, 0.0, 1e-30, 1e-6, 0.5, 1, 2, 100]),
    "top_p": st.sampled_from([1e-30, 1e-9, 0.5, 1, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB, 2**31 - 1]),
    "min_p": st.sampled_from([0, 1e-9, 0.5, 0.999, 1.0]),
    "presence_penalty": st.sampled_from([-2, -2.0, 0, 2, 2.0]),
    "frequency_penalty": st.sampled_from([-2, 0, 2]),
    "repetition_penalty": st.sampled_from([1e-30, 1e-6, 0.5, 1, 10]),
    "seed": st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1]),
    "stop": st.one_of(st.text(min_size=1, max_size=8), st.lists(st.text(min_size=1, max_size=8), max_size=16)),
    "stop_token_ids": st.lists(edge_token, max_size=8),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "stream": st.booleans(),
    "logit_bias": st.just({}),
    "user": st.text(max_size=8),
}


@st.composite
def valid_completion_body(draw):
    body = draw(st.fixed_dictionaries({"prompt": st.one_of(
        st.text(min_size=1, max_size=12).filter(str.strip), st.lists(edge_token, min_size=1, max_size=4),
        st.lists(st.lists(edge_token, min_size=1, max_size=3), min_size=1, max_size=2))},
        optional={**VALID_SAMPLING, "logprobs": st.integers(0, 20), "echo": st.booleans()}))
    body["max_tokens"] = draw(st.integers(1, 2))
    body["min_tokens"] = draw(st.integers(0, body["max_tokens"]))
    if body.get("echo"):
        body.pop("logprobs", None)
    if draw(st.booleans()):
        body["best_of"] = body.get("n", 1)
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


@st.composite
def valid_chat_body(draw):
    msgs = draw(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.text(max_size=12)}), min_size=1, max_size=3))
    body = draw(st.fixed_dictionaries({"messages": st.just(msgs)}, optional={
        **VALID_SAMPLING, "add_generation_prompt": st.booleans(), "tool_choice": st.just("none"),
        "response_format": st.just({"type": "text"})}))
    body["max_completion_tokens" if draw(st.booleans()) else "max_tokens"] = draw(st.integers(1, 2))
    body["min_tokens"] = draw(st.integers(0, 1))
    if draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 20))
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


def _nested(depth: int, key: str) -> bytes:
    return (f'{{"{key}": ' + "[" * depth + "1" + "]" * depth + "}").encode()


def raw_bodies(key: str):
    """Bytes that are not (or barely) JSON: the parser's own edges."""
    return st.one_of(
        st.binary(max_size=64),
        st.integers(3, 5000).map(lambda d: _nested(d, key)),
        st.integers(1, 3000).map(lambda d: (f'{{"{key}": ' + '{"a": ' * d + "1" + "}" * d + "}").encode()),
        st.sampled_from([b"", b"null", b"[]", b"1", b'"x"', b"{", b'{"%s": NaN}' % key.encode(),
                         b'{"%s": "x", "max_tokens": Infinity}' % key.encode(),
                         b'{"%s": "x", "top_k": -Infinity}' % key.encode(),
                         b'{"%s": "x", "max_tokens": 1e400}' % key.encode(),
                         b'{"%s": "x", "n": 1.0}' % key.encode(),
                         b'{"%s": "x", "seed": 123456789012345678901234567890}' % key.encode(),
                         b'{"%s": "x", "%s": "y", "max_tokens": 1}' % (key.encode(), key.encode()),
                         b'\xef\xbb\xbf{"prompt": "x"}', b'{"prompt": "\xff\xfe"}', b'{"prompt": "\\ud800"}']))


def _as_bytes(body) -> bytes:
    if isinstance(body, bytes):
        return body
    return json.dumps(body, allow_nan=True).encode()  # NaN / Infinity as raw tokens


# ------------------------------------------------------------------------------------------ the property
def _named(err: dict, sent: bytes) -> bool:
    if err.get("param"):
        return True
    msg = err.get("message") or ""
    head = msg.split(":", 1)[0]
    return (("body" in msg or "JSON" in msg) or (head and head.replace(".", "").replace("_", "").isalnum()
                                                 and head.split(".")[0].encode() in sent))


def _check(srv, path: str, body) -> None:
    sent = _as_bytes(body)
    stream = isinstance(body, dict) and body.get("stream") is True
    COUNTS["bodies"] += 1
    t0 = time.monotonic()
    try:
        if stream:
            with srv.client.stream("POST", path, content=sent, headers={"content-type": "application/json"}) as r:
                status, text = r.status_code, r.read().decode("utf-8", "replace")
        else:
            r = srv.client.post(path, content=sent, headers={"content-type": "application/json"})
            status, text = r.status_code, r.text
    except httpx.HTTPError as e:
        COUNTS["transport_errors"] += 1
        FAILURES.append(f"{path} {sent[:300]!r}: {type(e).__name__}: {e}")
        raise AssertionError(f"transport error {e!r} for {sent[:300]!r}") from None
    COUNTS[f"{status // 100}xx"] += 1
    took = time.monotonic() - t0
    SECONDS[f"{status // 100}xx"] += took
    SLOWEST.append((took, f"{status} {sent[:120]!r}"))
    SLOWEST.sort(reverse=True)
    del SLOWEST[5:]
    if status >= 500:
        COUNTS["500s" if status == 500 else "other_5xx"] += 1
        FAILURES.append(f"{path} {sent[:300]!r} -> {status} {text[:300]}")
    assert status < 500, f"{status} for {path} {sent[:300]!r}: {text[:500]}"
    if 400 <= status < 500:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}, text
        assert isinstance(err["message"], str) and err["message"], text
        assert _named(err, sent), f"error names no field: {text} for {sent[:300]!r}"
        PARAMS[f"{status} {err['param'] or err['code']}"] += 1
        return
    assert status == 200, text
    if stream:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", text[-300:]
        for e in events[:-1]:
            ev = json.loads(e)
            if "error" in ev:  # an in-band error after the headers: must not be a server fault
                COUNTS["stream_errors"] += 1
                assert ev["error"]["type"] != "internal_server_error", e
            else:
                assert "choices" in ev, e
    else:
        data = json.loads(text)
        assert data["choices"] and data["usage"]["completion_tokens"] >= 0, text


def _alive(srv) -> None:
    r = srv.client.get("/health")
    if r.status_code != 200:
        COUNTS["engine_deaths"] += 1
        FAILURES.append(f"/health {r.status_code} after {COUNTS['bodies']} bodies")
    assert r.status_code == 200, f"engine dead after {COUNTS['bodies']} bodies"


def _maybe_health(srv) -> None:
    if COUNTS["bodies"] % HEALTH_EVERY == 0:
        _alive(srv)


_settings = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=SEED is None,
                     suppress_health_check=list(HealthCheck))


def FUZZ(test):
    return _settings(seed(int(SEED))(test) if SEED is not None else test)


@FUZZ
@given(body=st.one_of(*[completion_body] * 5, valid_completion_body(), raw_bodies("prompt")))
def test_fuzz_completions(srv, body):
    _check(srv, COMP, body)
    _maybe_health(srv)


@FUZZ
@given(body=st.one_of(*[chat_body] * 5, valid_chat_body(), raw_bodies("messages")))
def test_fuzz_chat_completions(srv, body):
    _check(srv, CHAT, body)
    _maybe_health(srv)


def test_after_the_fuzz_the_server_answers(srv):
    t0 = time.monotonic()
    _alive(srv)
    r = srv.client.post(COMP, json={"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = srv.client.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    g = srv.client.get("/metrics").text
    assert "turnout_engine_healthy 1.0" in g
    assert time.monotonic() - t0 < 30
    print(f"\nfuzz: {dict(COUNTS)}")
    assert COUNTS["500s"] == 0 and COUNTS["engine_deaths"] == 0, FAILURES[:10]
