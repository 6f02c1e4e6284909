"""A fuzzer over the structured-output and tool fields against the real `turnout serve` (the shared
``server`` fixture, the embedded model): random and hostile JSON schemas (deep, remote ``$ref``, large
repetitions and enums), regexes, choices, EBNF grammars, structural tags, tools, ``tool_choice`` and
assistant ``tool_calls`` arguments, on /v1/completions, /v1/chat/completions and /tokenize.

Properties over the whole run: no 5xx; every 4xx OpenAI-shaped; a concurrent ``/health`` never takes a
second (no grammar work on the event loop); the server's resident memory grows by less than
``RSS_GROWTH_MB`` (the grammar cache is bounded in bytes, oversized specs are refused before compiling).
``TURNOUT_GRAMMAR_FUZZ_EXAMPLES`` sets the number of bodies (CI: 60, about a minute on a 2-core box).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_serve_grammar_limits import HealthWatch

EXAMPLES = int(os.environ.get("TURNOUT_GRAMMAR_FUZZ_EXAMPLES", "60"))
RSS_GROWTH_MB = 400

# Repetition bounds: small ones compile in milliseconds, huge ones must be refused by the pre-check.
BOUNDS = st.sampled_from(["", "{2}", "{1,5}", "{0,17}", "{3,}", "{1,10000}", "{99999}", "*", "+", "?"])
ATOMS = st.sampled_from(["a", "b", "[a-c]", "[0-9]", "\\d", "x|y", "(ab)", "(", ")", "[", "\\", "{", "}", "^", "$"])
REGEX = st.lists(st.tuples(ATOMS, BOUNDS).map("".join), min_size=1, max_size=6).map("".join)
DEEP_TEXT = st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)
REFS = st.sampled_from(["#", "#/$defs/a", "#/nope", "https://example.com/s.json", "file:///etc/passwd", "other.json"])
SCALAR_SCHEMA = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "nonsense"])}),
    st.fixed_dictionaries({"type": st.just("string"), "pattern": REGEX}),
    st.fixed_dictionaries({"enum": st.one_of(st.lists(st.text(max_size=8), min_size=1, max_size=5),
                                             st.integers(1, 6000).map(lambda n: [str(i) for i in range(n)]))}),
    st.fixed_dictionaries({"$ref": REFS}),
    st.fixed_dictionaries({"type": st.just("string"), "maxLength": st.integers(-1, 10 ** 6)}),
)


def _deepen(levels: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(levels):
        s = {"type": "array", "items": s}
    return s


SCHEMA = st.one_of(
    st.recursive(SCALAR_SCHEMA, lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"),
                               "properties": st.dictionaries(st.text("abcdef", min_size=1, max_size=3), inner,
                                                             max_size=3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)})), max_leaves=8),
    st.integers(1, 110).map(_deepen))
GRAMMAR = st.lists(st.sampled_from(["root ::= ", "root", ' "a"', " a", "\na ::= ", " | ", "(", ")", "*", "{1,5000}",
                                    '"b"{2}', " [a-z]", "::="]), min_size=1, max_size=8).map("".join)
JSON_TEXT = st.one_of(DEEP_TEXT, SCHEMA.map(json.dumps), st.text(max_size=20))
TOOLS = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "h"]), "parameters": SCHEMA})}), min_size=1, max_size=3)
TOOL_CHOICE = st.sampled_from(["none", "required", "auto", {"type": "function", "function": {"name": "f"}}, "bogus"])

FIELDS = st.one_of(
    st.builds(lambda s: {"guided_json": s}, st.one_of(SCHEMA, JSON_TEXT)),
    st.builds(lambda s: {"guided_regex": s}, REGEX),
    st.builds(lambda c: {"guided_choice": c},
              st.one_of(st.lists(st.text(max_size=6), min_size=1, max_size=4),
                        st.integers(1, 6000).map(lambda n: [str(i) for i in range(n)]))),
    st.builds(lambda g: {"guided_grammar": g}, GRAMMAR),
    st.builds(lambda t: {"structural_tag": t}, JSON_TEXT),
    st.builds(lambda k, v: {"structured_outputs": {k: v}}, st.sampled_from(["json", "regex", "grammar"]),
              st.one_of(REGEX, JSON_TEXT, GRAMMAR)),
    st.builds(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}},
              SCHEMA),
)
CHAT_ONLY = st.one_of(
    st.builds(lambda t, c: {"tools": t, "tool_choice": c}, TOOLS, TOOL_CHOICE),
    st.builds(lambda a: {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": a}}]}]}, JSON_TEXT),
)
REQUEST = st.one_of(
    st.tuples(st.just("/v1/completions"), FIELDS),
    st.tuples(st.just("/v1/chat/completions"), st.one_of(FIELDS, CHAT_ONLY)),
    st.tuples(st.just("/tokenize"), CHAT_ONLY),
)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_grammar_fields_fuzz(server, model_name):
    pid = getattr(getattr(server, "proc", None), "pid", None)
    client = httpx.Client(base_url=server.base_url, timeout=120)
    # warm up (the grammar compiler and its vocabulary are made at the first structured request)
    assert client.post("/v1/completions", json={"model": model_name, "prompt": "Hi", "max_tokens": 1,
                                                "guided_choice": ["a", "b"]}).status_code == 200
    rss0 = _rss_mb(pid) if pid else None
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(REQUEST)
    def one(request):
        path, fields = request
        body = {"model": model_name, "max_tokens": 2, **fields}
        if path == "/v1/completions":
            body["prompt"] = "Hi"
        elif path == "/tokenize":
            body.pop("max_tokens")
            body.setdefault("messages", [{"role": "user", "content": "Hi"}])
            body.pop("tool_choice", None)
        else:
            body.setdefault("messages", [{"role": "user", "content": "Hi"}])
        r = client.post(path, json=body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, json.dumps(fields)[:300], r.text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"] and err["type"], err

    t = time.monotonic()
    with HealthWatch(server.base_url) as watch:
        one()
    print(f"grammar fuzz: {EXAMPLES} bodies in {time.monotonic() - t:.1f} s, statuses {seen}, "
          f"worst /health {watch.worst:.3f} s")
    assert watch.worst < 1.0, watch.worst
    if rss0 is not None:
        grew = _rss_mb(pid) - rss0
        assert grew < RSS_GROWTH_MB, f"the server's RSS grew by {grew:.0f} MB"
    client.close()
