"""No request can stall `turnout serve` through a grammar or nested JSON (the real server, default model).

Grammars are built and compiled on worker threads, never on the event loop, under a deadline
(``--grammar-timeout``), in two lanes so compiles left running by large requests never delay a small one;
a cheap pre-check refuses oversized specs before any compile; JSON inside string fields is parsed with a
depth bound. Each test watches ``/health`` on another connection while the hostile request runs: it must
keep answering within a second.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import MAIN_SERVER_ARGS, ServerProcess

DEEP = "[" * 5000 + "]" * 5000
PATTERN_194 = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "string", "pattern": "b{1,10000}"}}}}


def _deep_schema(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def _tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


class HealthWatch:
    """GET /health in a loop on its own connection; ``worst`` is the slowest answer seen."""

    def __init__(self, base_url: str):
        self.base_url, self.worst, self.count = base_url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t = time.monotonic()
                c.get(f"{self.base_url}/health")
                self.worst = max(self.worst, time.monotonic() - t)
                self.count += 1
                time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)


def _post(base_url: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=timeout)


def _complete(model_name, **fields) -> dict:
    return {"model": model_name, "prompt": "Hello", "max_tokens": 2, **fields}


def _chat(model_name, **fields) -> dict:
    return {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def test_194_byte_schema_is_refused_while_health_answers(server, model_name):
    body = _chat(model_name, **PATTERN_194)
    with HealthWatch(server.base_url) as watch:
        t = time.monotonic()
        r = _post(server.base_url, "/v1/chat/completions", body)
        took = time.monotonic() - t
        time.sleep(0.3)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema" and "10000" in err["message"]
    assert took < 5 and watch.worst < 1.0, (took, watch.worst)


def test_slow_allowed_compile_keeps_the_loop_responsive(server, model_name):
    """A spec within the limits that takes a second or more to compile: /health keeps answering meanwhile."""
    body = _complete(model_name, guided_regex=f"[a-z]{{1,200}}q{time.time_ns()}", max_tokens=1)
    with HealthWatch(server.base_url) as watch:
        r = _post(server.base_url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert watch.count >= 2 and watch.worst < 1.0, (watch.count, watch.worst)


def test_five_deep_tools_are_refused_quickly(server, model_name):
    tools = [_tool(f"f{i}", _deep_schema(60)) for i in range(5)]  # 180 JSON levels each
    with HealthWatch(server.base_url) as watch:
        t = time.monotonic()
        r = _post(server.base_url, "/v1/chat/completions", _chat(model_name, tools=tools, tool_choice="required"))
        took = time.monotonic() - t
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools[0].function.parameters"
    assert "nested more than" in r.json()["error"]["message"]
    assert took < 5 and watch.worst < 1.0, (took, watch.worst)


def _assistant_call(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


REMOTE = {"$ref": "https://example.com/schema.json"}
# (endpoint, the request's fields, the field the 400 must name): JSON nested in strings, remote refs,
# oversized repetitions and value lists, an unproductive grammar; on chat, completions and /tokenize.
CASES = [
    ("completions", {"guided_json": DEEP}, "guided_json"),
    ("completions", {"guided_json": _deep_schema(70)}, "guided_json"),
    ("completions", {"guided_json": {"type": "string", "pattern": "b{1,10000}"}}, "guided_json"),
    ("completions", {"guided_json": REMOTE}, "guided_json"),
    ("completions", {"structured_outputs": {"json": DEEP}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"regex": "a{1,99999}"}}, "structured_outputs.regex"),
    ("completions", {"structural_tag": DEEP}, "structural_tag"),
    ("completions", {"guided_grammar": "root ::= root"}, "guided_grammar"),
    ("completions", {"guided_regex": "b{1,10000}"}, "guided_regex"),
    ("completions", {"guided_choice": [str(i) for i in range(5000)]}, "guided_choice"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": REMOTE}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep_schema(70)}}},
     "response_format.json_schema.schema"),
    ("chat", {"guided_json": DEEP}, "guided_json"),
    ("chat", {"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar"),
    ("chat", {"structured_outputs": {"structural_tag": DEEP}}, "structured_outputs.structural_tag"),
    ("chat", {"tools": [_tool("f", _deep_schema(70))]}, "tools[0].function.parameters"),
    ("chat", {"tools": [_tool("f", REMOTE)], "tool_choice": "required"}, "tools[0].function.parameters"),
    ("chat", {"messages": _assistant_call(DEEP)}, "messages.1.tool_calls.0.function.arguments"),
    ("tokenize", {"tools": [_tool("f", _deep_schema(70))]}, "tools[0].function.parameters"),
    ("tokenize", {"tools": [_tool("f", {"type": "string", "pattern": "b{1,10000}"})]}, "tools[0].function.parameters"),
    ("tokenize", {"messages": _assistant_call(DEEP)}, "messages.1.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize("endpoint,fields,param", CASES, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(CASES)])
def test_bad_input_is_a_400_naming_the_field(server, model_name, endpoint, fields, param):
    if endpoint == "completions":
        path, body = "/v1/completions", _complete(model_name, **fields)
    elif endpoint == "chat":
        path, body = "/v1/chat/completions", _chat(model_name, **fields)
    else:
        path, body = "/tokenize", {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], **fields}
    r = _post(server.base_url, path, body, timeout=30)
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


def test_a_grammar_dead_end_ends_the_answer(server, model_name):
    """``b ::= b`` after "a": the text can go nowhere, so the answer ends there ("stop"), not a 500."""
    r = _post(server.base_url, "/v1/completions",
              _complete(model_name, guided_grammar='root ::= "a" b\nb ::= b', max_tokens=5))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("a", "stop")


@pytest.fixture(scope="module")
def short_deadline():
    """A server whose grammar deadline is one second, and a regex that takes longer than that to compile
    (``.`` repeated: every token fits at every position)."""
    srv = ServerProcess(*MAIN_SERVER_ARGS, "--grammar-timeout", "1")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def _slow_regex(tag: str) -> str:
    return f".{{1,250}}{tag}{time.time_ns()}"


def test_deadline_is_a_400_naming_the_field(short_deadline):
    body = {"prompt": "Hi", "max_tokens": 1, "structured_outputs": {"regex": _slow_regex("d")}}
    with HealthWatch(short_deadline.base_url) as watch:
        t = time.monotonic()
        r = _post(short_deadline.base_url, "/v1/completions", body)
        took = time.monotonic() - t
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "structured_outputs.regex" and err["code"] == "grammar_timeout", err
    assert "took longer than 1 s" in err["message"]
    assert took < 3 and watch.worst < 1.0, (took, watch.worst)


def test_abandoned_compiles_do_not_block_a_trivial_choice(short_deadline):
    """Eight slow compiles whose clients leave at once, then a trivial guided_choice: answered promptly
    (the slow ones share the heavy lane; queued ones are dropped when their client leaves)."""
    def abandon(i):
        try:
            httpx.post(f"{short_deadline.base_url}/v1/completions", timeout=0.3,
                       json={"prompt": "Hi", "max_tokens": 1, "guided_regex": _slow_regex(f"a{i}")})
        except httpx.TimeoutException:
            pass

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(abandon, range(8)))
    t = time.monotonic()
    r = _post(short_deadline.base_url, "/v1/completions",
              {"prompt": "Is the sky blue?", "max_tokens": 1, "guided_choice": ["yes", "no"]})
    took = time.monotonic() - t
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text and ("yes".startswith(text) or "no".startswith(text)), text
    assert took < 8, took  # under old code it queued behind the abandoned compiles (tens of seconds)
