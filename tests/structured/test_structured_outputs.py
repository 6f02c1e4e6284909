"""Structured output with the embedded SmolLM2 tokenizer: constrained random walks through the real grammar
compiler, the apply_token_bitmask op and a sampler, whose texts must satisfy their constraint; the cache;
the errors that name their field; the request-field conversions.

A walk draws random logits each step (with a bias toward short punctuation and digit tokens and the stop
token, so that strings and numbers end within a few hundred steps), fills the batch's bitmask rows on
the host, applies the mask through the dispatched op, samples, and accepts the token. Rows of different
constraints and one unconstrained row share each batch.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest
import torch

from structured_helpers import check_schema, constrained_walk
from turnout.structured import StructuredOutputsError, StructuredOutputsParams
from turnout.structured.compiler import GrammarCompiler
from turnout.structured.matcher import allocate_bitmask
from turnout.structured.request import from_request

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
     "minItems": 1, "maxItems": 3}, "score": {"type": "number", "minimum": -1, "maximum": 1}},
     "required": ["tags", "score"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"},
     "email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}}, "required": ["id", "email"]},
     "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 4},
     "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"]}, "maxItems": 2}},
     "required": ["user", "items"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
     "required": ["value"]},
]


@pytest.mark.parametrize("whitespace", [True, False], ids=["any-ws", "compact"])
def test_json_schema_walks_validate(tok, compiler, walk_tools, whitespace):
    params = [StructuredOutputsParams(json=s, disable_any_whitespace=not whitespace) for s in SCHEMAS]
    texts = constrained_walk(tok, compiler, walk_tools, params + [None], seed=1 if whitespace else 2)
    for schema, text in zip(SCHEMAS, texts):
        check_schema(json.loads(text), schema)
        if not whitespace:
            assert not re.search(r'[\s]', re.sub(r'"(\\.|[^"\\])*"', '""', text)), text


def test_json_object_regex_choice_grammar_walks(tok, compiler, walk_tools):
    choices = ["yes", "no", 'say "maybe"\n', "naïve"]
    regex = r"[A-Z][a-z]{2,6}-\d{2,3}"
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "[" [0-9]+ "]"'
    params = [StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex=regex),
              StructuredOutputsParams(choice=choices), StructuredOutputsParams(grammar=grammar), None]
    for seed in range(3):
        obj, rx, ch, gr, _ = constrained_walk(tok, compiler, walk_tools, params, seed=10 + seed)
        assert isinstance(json.loads(obj), dict)
        assert re.fullmatch(regex, rx), rx
        assert ch in choices, ch
        assert re.fullmatch(r"\((?:[a-c]|\[[0-9]+\])(?:,(?:[a-c]|\[[0-9]+\]))*\)", gr), gr


def test_every_choice_is_reachable(tok, compiler, walk_tools):
    choices = ["alpha", "beta", "gamma"]
    seen = set(constrained_walk(tok, compiler, walk_tools, [StructuredOutputsParams(choice=choices)] * 12, seed=5))
    assert seen == set(choices)


def test_mask_forbids_what_the_grammar_refuses(tok, compiler):
    # Every token the mask allows is accepted, every token it forbids is refused (first step of a regex).
    state = compiler.new_state(StructuredOutputsParams(regex=r"ab[0-9]+"))
    mask = allocate_bitmask(1, compiler.vocab_size)
    assert state.fill_bitmask(mask, 0)
    bits = ((mask[0].long()[:, None] >> torch.arange(32)) & 1).flatten()[: compiler.vocab_size].bool()
    allowed = bits.nonzero()[:, 0].tolist()
    assert allowed and all(tok.decode([t]) in ("a", "ab") or "ab".startswith(tok.decode([t])) for t in allowed)
    assert not bits[len(tok):].any()  # padding ids never allowed
    for t in allowed[:5]:
        twin = state.fork()
        assert twin.accept_token(t)
    refused = next(t for t in range(len(tok)) if not bits[t])
    assert not state.accept_token(refused) and state.num_accepted == 0


def test_rollback_and_terminated_state(tok, compiler):
    state = compiler.new_state(StructuredOutputsParams(choice=["ok"]))
    ids = tok.encode("ok", add_special_tokens=False)
    assert state.accept_tokens(ids) == len(ids) and state.is_completed()
    stop = compiler.stop_token_ids[0]
    assert state.accept_token(stop) and state.is_terminated()
    mask = allocate_bitmask(1, compiler.vocab_size)
    state.fill_bitmask(mask, 0)  # terminated: only the stop tokens stay open
    bits = ((mask[0].long()[:, None] >> torch.arange(32)) & 1).flatten()
    assert set(bits.nonzero()[:, 0].tolist()) == set(compiler.stop_token_ids)
    state.rollback(1)
    assert not state.is_terminated() and state.is_completed()
    state.rollback(len(ids))
    assert not state.is_completed() and state.num_accepted == 0
    with pytest.raises(ValueError, match="rollback"):
        state.rollback(1)


def test_cache_compiles_once_per_canonical_spec_across_threads(tok):
    compiler = GrammarCompiler(tok, vocab_size=len(tok))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    results, barrier = [], threading.Barrier(6)

    def worker(spec):
        barrier.wait()
        results.append(compiler.compile(StructuredOutputsParams(json=spec)))

    specs = [schema, json.dumps(schema), json.dumps(schema, indent=2)] * 2  # the same schema, three spellings
    threads = [threading.Thread(target=worker, args=(s,)) for s in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1
    info = compiler.cache_info()
    assert (info.misses, info.hits + info.misses, info.size) == (1, 6, 1)
    # property order is part of the identity (xgrammar emits properties in schema order)
    reordered = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    assert compiler.compile(StructuredOutputsParams(json=reordered)) is not results[0]
    assert compiler.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True)) is not results[0]

    async def main():
        return await asyncio.gather(*[compiler.compile_async(StructuredOutputsParams(regex="x+")) for _ in range(4)])

    compiled = asyncio.run(main())
    assert len({id(c) for c in compiled}) == 1


def test_cache_is_bounded(tok):
    compiler = GrammarCompiler(tok, vocab_size=len(tok), cache_size=2)
    first = compiler.compile(StructuredOutputsParams(regex="a"))
    compiler.compile(StructuredOutputsParams(regex="b"))
    compiler.compile(StructuredOutputsParams(regex="c"))
    assert compiler.cache_info().size == 2
    assert compiler.compile(StructuredOutputsParams(regex="a")) is not first  # evicted, compiled again


@pytest.mark.parametrize("kwargs,field,words", [
    ({"json": {"type": "objectx"}}, "json", "Unsupported type"),
    ({"json": '{"type": "object", '}, "json", "not valid JSON"),
    ({"json": [1, 2]}, "json", "must be an object"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}}, "json", "invalid JSON schema"),
    ({"regex": "(ab"}, "regex", "invalid regex"),
    ({"regex": ""}, "regex", "non-empty"),
    ({"grammar": 'root ::= "a" | undefined_rule'}, "grammar", "undefined_rule"),
    ({"choice": []}, "choice", "non-empty"),
    ({"choice": ["a", 3]}, "choice", "must be a string"),
    ({"structural_tag": "{nope"}, "structural_tag", "not valid JSON"),
    ({"structural_tag": '{"type": "structural_tag", "format": {"type": "nonsense"}}'}, "structural_tag", "invalid"),
    ({}, "structured_outputs", "no constraint"),
    ({"regex": "a", "choice": ["a"]}, "choice", "only one"),
    ({"json": {}, "whitespace_pattern": " "}, "whitespace_pattern", "not supported"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "disable_any_whitespace", "boolean"),
])
def test_invalid_specs_name_the_field(kwargs, field, words):
    with pytest.raises(StructuredOutputsError, match=re.escape(words)) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")
    assert isinstance(e.value, ValueError)
    assert "/project/" not in str(e.value) and ".cc:" not in str(e.value)  # no C++ source locations


def test_request_fields_to_params():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    p = from_request(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                             "strict": True}})
    assert p.kind == "json" and p.schema() == schema
    assert from_request(response_format={"type": "json_object"}).kind == "json_object"
    assert from_request(response_format={"type": "json_schema", "json_schema": {"name": "any"}}).kind == "json_object"
    assert from_request(response_format={"type": "text"}) is None
    assert from_request({"messages": []}) is None
    assert from_request({"guided_regex": "a+"}).regex == "a+"
    assert from_request(guided_choice=["a", "b"]).choice == ["a", "b"]
    assert from_request(guided_grammar='root ::= "a"').kind == "grammar"
    assert from_request(guided_json=json.dumps(schema)).schema() == schema
    assert from_request(structured_outputs={"regex": "b+", "disable_any_whitespace": True}).regex == "b+"
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    assert from_request(response_format=tag).kind == "structural_tag"

    class Req:  # attribute access, as on a pydantic request model
        guided_json = schema
        response_format = None
    assert from_request(Req()).schema() == schema


@pytest.mark.parametrize("fields,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_json": "{", "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": {}, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"choice": ["a", None]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_request_errors_name_the_request_field(fields, field):
    with pytest.raises(StructuredOutputsError) as e:
        from_request(**fields)
    assert e.value.field == field, str(e.value)


def test_threaded_batch_fill_equals_row_by_row(tok, compiler):
    from turnout.structured.matcher import batch_filler, fill_batch_bitmask

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    states = [compiler.new_state(StructuredOutputsParams(json=schema)) for _ in range(9)]
    states[3] = None  # an unconstrained row
    states[4].accept_tokens(tok.encode('{"name": "Bo', add_special_tokens=False))
    states[5] = compiler.new_state(StructuredOutputsParams(choice=["x"]))
    states[5].accept_tokens(tok.encode("x", add_special_tokens=False) + [compiler.stop_token_ids[0]])
    assert states[5].is_terminated()
    serial, threaded = allocate_bitmask(9, compiler.vocab_size), allocate_bitmask(9, compiler.vocab_size)
    rows = fill_batch_bitmask(states, serial)
    rows_t = fill_batch_bitmask(states, threaded, threads=batch_filler(2), parallel_from=2)
    assert torch.equal(serial, threaded) and rows == rows_t == [0, 1, 2, 4, 5, 6, 7, 8]
    assert not torch.equal(serial[4], serial[0])  # the advanced row differs
    assert (serial[3] == -1).all()  # the unconstrained row is untouched


def test_structural_tag_walks_both_shapes(tok, compiler, walk_tools):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<answer>",
                                                "content": {"type": "json_schema", "json_schema": schema},
                                                "end": "</answer>"}}
    for text in constrained_walk(tok, compiler, walk_tools, [StructuredOutputsParams(structural_tag=json.dumps(tag))] * 2,
                                 seed=8):
        assert text.startswith("<answer>") and text.endswith("</answer>"), text
        check_schema(json.loads(text[len("<answer>"):-len("</answer>")]), schema)
    # vLLM's first shape: free text, and after a trigger the tagged JSON
    legacy = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": schema, "end": "</function>"}]}
    state = compiler.new_state(StructuredOutputsParams(structural_tag=json.dumps(legacy)))
    ids = tok.encode('Sure. <function=get_weather>{"city": "Oslo"}</function> done', add_special_tokens=False)
    assert state.accept_tokens(ids) == len(ids)
    bad = compiler.new_state(StructuredOutputsParams(structural_tag=json.dumps(legacy)))
    ids = tok.encode('<function=get_weather>{"town": "Oslo"}', add_special_tokens=False)
    assert bad.accept_tokens(ids) < len(ids)  # the schema holds inside the tag
    with pytest.raises(StructuredOutputsError, match="missing field 'end'"):
        StructuredOutputsParams(structural_tag={"structures": [{"begin": "<a>"}], "triggers": ["<a>"]})


def test_without_xgrammar_the_error_says_so(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(RuntimeError, match="structured output needs the xgrammar package"):
        StructuredOutputsParams(regex="a")
