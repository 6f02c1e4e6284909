"""The pre-check of structured-output specs (turnout/structured/limits.py), the byte-bounded grammar cache,
the grammar worker lanes and deadline (turnout/structured/workers.py), and JSON nested too deeply in
the places a client or a model can put it."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

from turnout.structured import StructuredOutputsError, StructuredOutputsParams
from turnout.structured.compiler import GrammarCompiler
from turnout.structured.limits import is_light, json_depth, loads_json, regex_repeat
from turnout.structured.request import from_request
from turnout.structured.workers import GrammarTimeout, GrammarWorkers

DEEP = "[" * 5000 + "]" * 5000  # json.loads alone raises RecursionError on it


def _deep_schema(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


@pytest.mark.parametrize("pattern,largest,total", [
    ("abc", 1, 0), ("b{1,10000}", 10000, 10000), ("(a{1,10}){1,10}x{5}", 100, 105),
    (r"\{1,5000}", 1, 0), ("[{]{1,2}", 2, 2), ("[a-z]{1,300}x|[a-z]{1,300}y", 300, 600), ("x{3,}", 3, 3)])
def test_regex_repeat(pattern, largest, total):
    assert regex_repeat(pattern) == (largest, total)


def test_json_depth_skips_strings():
    assert json_depth('{"a": "[[[[", "b": [[1]]}') == 3
    assert json_depth(DEEP) == 5000
    with pytest.raises(ValueError, match="nested 5000 levels"):
        loads_json(DEEP)


@pytest.mark.parametrize("kwargs,field,words", [
    ({"json": {"type": "string", "pattern": "b{1,10000}"}}, "json", "repetition of up to 10000"),
    ({"json": {"type": "string", "pattern": "((ab){1,30}c){1,30}"}}, "json", "repetition of up to 900"),
    ({"json": DEEP}, "json", "nested 5000 levels"),
    ({"json": _deep_schema(40)}, "json", "nested more than 64"),
    ({"json": {"$ref": "https://example.com/schema.json"}}, "json", "only references inside the schema"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "other.json#/a"}}}}, "json", "only references"),
    ({"json": {"enum": [str(i) for i in range(5000)]}}, "json", "5000 enum/const values"),
    ({"json": {"enum": ["x" * 200_000]}}, "json", "characters in all"),
    ({"regex": "b{1,10000}"}, "regex", "repetition of up to 10000"),
    ({"regex": "|".join(f"[a-z]{{1,200}}x{i}" for i in range(10))}, "regex", "adding up to"),
    ({"choice": [str(i) for i in range(5000)]}, "choice", "5000 choice values"),
    ({"choice": ["x" * 200_000]}, "choice", "characters in all"),
    ({"grammar": 'root ::= "a"{1,5000}'}, "grammar", "repetition of up to 5000"),
    ({"grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(60_000))}, "grammar", "over the limit of"),
    ({"structural_tag": DEEP}, "structural_tag", "nested 5000 levels"),
])
def test_precheck_refuses_naming_the_field_quickly(kwargs, field, words):
    t = time.monotonic()
    with pytest.raises(StructuredOutputsError, match=words) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.field == field
    assert time.monotonic() - t < 0.5  # refused before any grammar is built


def test_request_fields_are_named():
    with pytest.raises(StructuredOutputsError) as e:
        from_request(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "b{1,10000}"}}})
    assert e.value.field == "response_format.json_schema.schema"
    with pytest.raises(StructuredOutputsError) as e:
        from_request(guided_json=DEEP)
    assert e.value.field == "guided_json"


def test_sizes_within_the_limits_are_accepted():
    StructuredOutputsParams(json=_deep_schema(15))
    StructuredOutputsParams(json={"type": "string", "pattern": "[a-z]{1,64}", "enum": None} | {"enum": ["a", "b"]})
    StructuredOutputsParams(json={"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}})
    StructuredOutputsParams(choice=[f"choice {i}" for i in range(1000)])


def test_unproductive_grammar_is_refused(compiler):
    with pytest.raises(StructuredOutputsError, match="allows no output") as e:
        compiler.compile(StructuredOutputsParams(grammar="root ::= root", field_names={"grammar": "guided_grammar"}))
    assert e.value.field == "guided_grammar"
    compiler.compile(StructuredOutputsParams(grammar='root ::= "a" root | "b"'))  # recursive but productive


def test_cache_is_bounded_in_bytes(tok):
    specs = [StructuredOutputsParams(regex=f"[a-z]{{1,20}}{i}") for i in range(4)]
    one = GrammarCompiler(tok, vocab_size=len(tok)).compile(specs[0]).memory_size_bytes
    assert one > 10_000
    compiler = GrammarCompiler(tok, vocab_size=len(tok), cache_bytes=int(2.5 * one))
    for s in specs:
        compiler.compile(StructuredOutputsParams(regex=s.regex))
    info = compiler.cache_info()
    assert info.size == 2 and info.bytes <= 2.5 * one, info  # by bytes, although the count bound is 256
    # a grammar larger than the whole bound is compiled and used, not kept
    tiny = GrammarCompiler(tok, vocab_size=len(tok), cache_bytes=100)
    tiny.compile(specs[0])
    assert tiny.cache_info().size == 0


def test_a_compiled_grammar_rides_on_its_params(tok):
    compiler = GrammarCompiler(tok, vocab_size=len(tok), cache_size=1)
    so = StructuredOutputsParams(regex="[0-9]+")
    first = compiler.compile(so)
    compiler.compile(StructuredOutputsParams(regex="[a-z]+"))  # evicts it from the cache
    assert compiler.compile(so) is first  # the engine's admission never compiles it again


def test_workers_deadline_and_lanes():
    """A deadline answers at once while the job runs on; an abandoned job gives its slot back (up to
    max_abandoned a lane, then it keeps it); a job waiting for a slot past its deadline never starts; a
    full heavy lane does not delay the light lane; a client that leaves stops the wait."""
    from turnout.structured.workers import Disconnected

    workers = GrammarWorkers(light_threads=1, heavy_threads=1, max_abandoned=1)
    release = threading.Event()
    started = []

    def slow(name):
        def run():
            started.append(name)
            release.wait(10)
            return name
        return run

    async def main():
        t = time.monotonic()
        with pytest.raises(GrammarTimeout):
            await workers.run(slow("a"), light=False, timeout=0.2)
        assert time.monotonic() - t < 1.0
        with pytest.raises(GrammarTimeout):  # "a" gave its slot back: "b" runs, and keeps its slot
            await workers.run(slow("b"), light=False, timeout=0.2)
        with pytest.raises(GrammarTimeout):  # no slot: never starts
            await workers.run(slow("c"), light=False, timeout=0.2)
        t = time.monotonic()
        assert await workers.run(lambda: "choice", light=True, timeout=5) == "choice"
        assert time.monotonic() - t < 0.5
        gone = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.1, gone.set_result, None)
        with pytest.raises(Disconnected):
            await workers.run(slow("d"), light=True, timeout=5, gone=gone)
        release.set()
        await asyncio.sleep(0.2)
        assert await workers.run(lambda: "after", light=False, timeout=5) == "after"  # every slot is back
        with pytest.raises(ZeroDivisionError):
            await workers.run(lambda: 1 / 0, light=True, timeout=5)

    asyncio.run(main())
    assert started == ["a", "b", "d"]


def test_is_light():
    assert is_light([None, ["yes", "no"]])
    assert is_light([{"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}])
    assert not is_light(["[a-z]{1,200}"])
    assert not is_light([{"enum": list(range(1000))}])
    assert not is_light([DEEP])


def test_deep_model_output_is_content_for_every_tool_parser():
    from turnout.entrypoints.openai.tool_parsers import get_tool_parser

    deep = '{"name": "f", "arguments": ' + "[" * 1000 + "]" * 1000 + "}"
    texts = {"hermes": f"<tool_call>{deep}</tool_call>", "llama3_json": deep, "mistral": f"[TOOL_CALLS][{deep}]"}
    for name, text in texts.items():
        parser = get_tool_parser(name)
        ext = parser.extract_tool_calls(text)
        assert ext.tool_calls == [] and ext.content, name
        stream = parser.streaming()
        for i in range(0, len(text), 64):
            stream.feed(text[i:i + 64])
        stream.finish()


def test_deep_tool_call_arguments_in_messages_are_a_400():
    from turnout.entrypoints.openai.chat_tools import template_messages
    from turnout.entrypoints.openai.errors import APIError

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    with pytest.raises(APIError) as e:
        template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert e.value.status == 400 and e.value.param == "messages.0.tool_calls.0.function.arguments"
    ok = {**call, "function": {"name": "f", "arguments": json.dumps({"a": [1]})}}
    assert template_messages([{"role": "assistant", "tool_calls": [ok]}])[0]["tool_calls"][0]["function"] == {
        "name": "f", "arguments": {"a": [1]}}


def test_a_dead_end_ends_the_sequence(tok, compiler):
    """``root ::= "a" b; b ::= b`` allows "a" and then nothing: the state allows only the stop tokens there
    (not a row of -inf), accepting one ends it, and rollback undoes it; row by row and batched."""
    from turnout.structured.matcher import allocate_bitmask, batch_filler, fill_batch_bitmask

    compiled = compiler.compile(StructuredOutputsParams(grammar='root ::= "a" b\nb ::= b'))
    (a,) = tok.encode("a", add_special_tokens=False)
    stop = compiler.stop_token_ids[0]
    for threads in (None, batch_filler(1)):
        states = [compiler.new_state(compiled) for _ in range(2)]
        for s in states:
            assert s.accept_token(a)
        bits = allocate_bitmask(2, compiler.vocab_size)
        assert fill_batch_bitmask(states, bits, threads=threads, parallel_from=1) == [0, 1]
        allowed = {int(t) for t in torch.nonzero(_unpack(bits[0], compiler.vocab_size)).flatten()}
        assert allowed == set(compiler.stop_token_ids)
        assert not states[0].accept_token(a)
        assert states[0].accept_token(stop) and states[0].is_terminated()
        states[0].rollback(2)
        assert not states[0].is_terminated() and states[0].num_accepted == 0 and states[0].accept_token(a)


def _unpack(row, vocab_size):
    ids = torch.arange(vocab_size)
    return (row[ids // 32] >> (ids % 32)) & 1


def test_regexes_and_grammars_inside_schemas_and_tags_are_checked():
    with pytest.raises(StructuredOutputsError, match="repetition"):
        StructuredOutputsParams(json={"type": "object", "patternProperties": {"^a{1,9999}$": {"type": "integer"}}})
    tag = {"type": "structural_tag", "format": {"type": "grammar", "grammar": 'root ::= "x"{1,9999}'}}
    with pytest.raises(StructuredOutputsError, match="repetition") as e:
        StructuredOutputsParams(structural_tag=json.dumps(tag))
    assert e.value.field == "structural_tag"
