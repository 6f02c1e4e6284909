"""Structured output through the real `turnout serve` (default model) with the official openai client:
``response_format`` json_object / json_schema on chat, vLLM's ``guided_*`` and ``structured_outputs`` on
both endpoints, 20 varied JSON schemas validated with jsonschema, streamed equal to non-streamed, and a
bad spec is a 400 naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=180)


S = {"type": "string", "maxLength": 10}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99}, "admin": {"type": "boolean"}},
        "required": ["id", "admin"]}}, "required": ["user"]},
    {"type": "object", "properties": {"city": S, "country": S}, "required": ["city", "country"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["n"]},
    {"type": "object", "properties": {"level": {"enum": ["low", "mid", "high"]}, "value": {"type": "integer",
                                                                                         "minimum": 0, "maximum": 9}},
     "required": ["level", "value"]},
    {"type": "object", "properties": {"points": {"type": "array", "items": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}, "minItems": 1, "maxItems": 2}}, "required": ["points"]},
    {"type": "object", "properties": {"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
     "required": ["title", "year"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "why": S}, "required": ["answer", "why"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100}, "currency":
                                      {"enum": ["USD", "EUR"]}}, "required": ["price", "currency"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}, "maxItems": 4}},
     "required": ["items"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"first": S, "last": S, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["first", "last", "age"]},
    {"type": "object", "properties": {"status": {"enum": ["active", "inactive"]}, "count": {"type": "integer",
                                                                                           "minimum": 0,
                                                                                           "maximum": 50}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180}},
     "required": ["lat", "lon"]},
    {"type": "object", "properties": {"word": S, "letters": {"type": "integer", "minimum": 1, "maximum": 20}},
     "required": ["word", "letters"]},
    {"type": "object", "properties": {"pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]},
                                               "minItems": 1, "maxItems": 3}}, "required": ["pets"]},
]


def _chat(client, model_name, text, **kw):
    return client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": text}],
                                          temperature=0, max_tokens=120, **kw)


def test_twenty_json_schemas_parse_and_validate(client, model_name):
    def one(i):
        schema = SCHEMAS[i]
        r = _chat(client, model_name, "Answer with JSON.",
                  response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                         "strict": True}})
        return schema, r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        for schema, choice in pool.map(one, range(len(SCHEMAS))):
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object(client, model_name):
    r = _chat(client, model_name, 'Repeat this JSON object exactly: {"a": 1}', response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_guided_fields_on_both_endpoints(client, model_name):
    r = _chat(client, model_name, "Pick one.", extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = client.completions.create(model=model_name, prompt="The code is", max_tokens=20, temperature=0.8, seed=3,
                                  n=2, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert len(r.choices) == 2 and all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.text) for c in r.choices)
    r = client.completions.create(model=model_name, prompt="Is water wet?", max_tokens=20, temperature=0,
                                  extra_body={"guided_grammar": 'root ::= "The answer is " ("yes" | "no") "."'})
    assert re.fullmatch(r"The answer is (yes|no)\.", r.choices[0].text)
    r = client.completions.create(model=model_name, prompt="A person:", max_tokens=80, temperature=0,
                                  extra_body={"guided_json": SCHEMAS[0]})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[0])
    r = _chat(client, model_name, "Pick a letter.", extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert r.choices[0].message.content in ("a", "b")


def test_streamed_equals_non_streamed(client, model_name):
    kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}},
              seed=5, logprobs=True, top_logprobs=2)
    whole = _chat(client, model_name, "A person as JSON.", **kw)
    parts = list(_chat(client, model_name, "A person as JSON.", stream=True, **kw))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMAS[0])
    # a forced token (probability 1 under the grammar) has logprob 0, not the -9999 of a masked one
    lps = [t.logprob for t in whole.choices[0].logprobs.content]
    assert all(-9999.0 < lp <= 0.0 for lp in lps) and max(lps) == 0.0


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
])
def test_a_bad_spec_is_a_400_naming_the_field(client, model_name, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    # the server serves on
    assert _chat(client, model_name, "hi", extra_body={"guided_choice": ["ok"]}).choices[0].message.content == "ok"
