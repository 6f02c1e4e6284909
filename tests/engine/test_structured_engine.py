"""Structured output end to end through the Python API: ``SamplingParams(structured_outputs=...)`` on the
embedded SmolLM2 (CPU). Every constrained answer parses and validates (jsonschema) or matches its regex /
choice / EBNF grammar, with n=2, seeds, logprobs, stop strings, min_tokens, async scheduling; the
unconstrained requests of a mixed batch get the tokens they get alone; a bad spec is a ValueError naming
the field, at admission."""

import json
import re

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402
from turnout.structured import StructuredOutputsError, StructuredOutputsParams  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["color", "score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "admin": {"type": "boolean"}},
        "required": ["id", "admin"]}}, "required": ["user"]},
]
EBNF = 'root ::= "The answer is " ("yes" | "no") "."'
REGEX = r"[0-9]{3}-[a-z]{2}"


def _chat(text):
    return [{"role": "user", "content": text}]


def _so(**kw):
    return StructuredOutputsParams(**kw)


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=64 << 20, async_scheduling=False)


def test_json_schemas_parse_and_validate(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=_so(json=s)) for s in SCHEMAS]
    params.append(SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=_so(json_object=True)))
    prompts = [_chat("Answer with a JSON object describing a person, a color, tags or a user.")] * len(SCHEMAS)
    prompts.append(_chat('Repeat this JSON object exactly: {"a": 1}'))
    outs = llm.chat(prompts, params, use_tqdm=False)
    for schema, out in zip(SCHEMAS + [{"type": "object"}], outs):
        c = out.outputs[0]
        assert out.error is None and c.finish_reason == "stop", (c.text, c.finish_reason)
        jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_and_ebnf_with_n2_and_seed(llm):
    params = [SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=20, structured_outputs=_so(regex=REGEX)),
              SamplingParams(temperature=0.9, seed=8, n=2, max_tokens=10,
                             structured_outputs=_so(choice=["alpha", "beta", "gamma delta"])),
              SamplingParams(temperature=0.9, seed=9, n=2, max_tokens=20, structured_outputs=_so(grammar=EBNF))]
    prompts = [_chat("Write a code like 123-ab."), _chat("Pick a Greek letter."), _chat("Is water wet?")]
    first = llm.chat(prompts, params, use_tqdm=False)
    again = llm.chat(prompts, params, use_tqdm=False)
    checks = [lambda t: re.fullmatch(REGEX, t), lambda t: t in ("alpha", "beta", "gamma delta"),
              lambda t: re.fullmatch(r"The answer is (yes|no)\.", t)]
    for out, out2, ok in zip(first, again, checks):
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert out.error is None and c.finish_reason == "stop" and ok(c.text), c.text
        # a seed reproduces every sample, grammar and all
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in out2.outputs]


def test_logprobs_are_of_the_masked_distribution(llm):
    tok = llm.get_tokenizer()
    p = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, structured_outputs=_so(choice=["yes", "no"]))
    c = llm.chat([_chat("Is the sky blue?")], p, use_tqdm=False)[0].outputs[0]
    assert c.text in ("yes", "no") and c.finish_reason == "stop"
    assert len(c.logprobs) == len(c.token_ids)
    for t, entry in zip(c.token_ids, c.logprobs):
        assert entry[t].rank == 1 and entry[t].logprob <= 0.0  # greedy: the best allowed token
        live = {u: lp.logprob for u, lp in entry.items() if lp.logprob > float("-inf")}
        assert sum(torch.tensor(list(live.values())).exp()) <= 1.0 + 1e-4
    # the first step allows only the first token of each choice: those hold all the probability mass
    first = {u for u, lp in c.logprobs[0].items() if lp.logprob > float("-inf")}
    assert all(any(ch.startswith(tok.decode([u])) for ch in ("yes", "no")) for u in first)
    assert abs(sum(torch.tensor([c.logprobs[0][u].logprob for u in first]).exp()) - 1.0) < 1e-3


def test_stop_strings_min_tokens_and_ignore_eos(llm):
    params = [
        # a stop string inside the constrained text ends it there
        SamplingParams(temperature=0.0, max_tokens=20, stop=["-"], structured_outputs=_so(regex=r"[a-z]{4}-[0-9]{4}")),
        # min_tokens cannot hold a grammar whose text is complete: the grammar wins (no all -inf row)
        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6, structured_outputs=_so(choice=["no"])),
        # ignore_eos: the sequence still ends when its grammar has terminated
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, structured_outputs=_so(choice=["maybe"])),
    ]
    outs = llm.chat([_chat("A code please."), _chat("Say no."), _chat("Say maybe.")], params, use_tqdm=False)
    a, b, c = (o.outputs[0] for o in outs)
    assert all(o.error is None for o in outs)
    assert re.fullmatch(r"[a-z]{4}", a.text) and a.finish_reason == "stop" and a.stop_reason == "-"
    assert b.text == "no" and b.finish_reason == "stop" and len(b.token_ids) < 6
    assert c.text == "maybe" and c.finish_reason == "stop" and len(c.token_ids) < 8


def _mixed():
    free = [(_chat("Tell me about the sea."), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
            (_chat("Name three fruits."), SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True,
                                                        logprobs=1))]
    constrained = [(_chat("A person as JSON."), SamplingParams(temperature=0.0, max_tokens=60,
                                                               structured_outputs=_so(json=SCHEMAS[0]))),
                   (_chat("A code."), SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=12,
                                                     structured_outputs=_so(regex=REGEX)))]
    return free, constrained


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def test_unconstrained_requests_are_unchanged_in_a_mixed_batch(llm):
    free, constrained = _mixed()
    alone = llm.chat([m for m, _ in free], [p for _, p in free], use_tqdm=False)
    batch = free[:1] + constrained[:1] + free[1:] + constrained[1:]
    mixed = llm.chat([m for m, _ in batch], [p for _, p in batch], use_tqdm=False)
    assert _summary([mixed[0], mixed[2]]) == _summary(alone)
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[0])
    assert all(re.fullmatch(REGEX, c.text) for c in mixed[3].outputs)


def test_async_scheduling_gives_the_same_outputs(llm):
    free, constrained = _mixed()
    batch = free + constrained
    want = llm.chat([m for m, _ in batch], [p for _, p in batch], use_tqdm=False)
    fast = LLM(kv_cache_memory=64 << 20, async_scheduling=True)
    assert fast.engine.async_scheduling
    got = fast.chat([m for m, _ in batch], [p for _, p in batch], use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert fast.engine.num_lookahead_steps > 0
    # grammar lanes take part in lookahead steps too: the forward is launched ahead, the sampling waits
    # for the previous token to be accepted (EngineCore.step)
    assert fast.engine.core.num_grammar_lookahead_steps > 0
    only = fast.chat([m for m, _ in constrained], [p for _, p in constrained], use_tqdm=False)
    assert _summary(only) == _summary(want[len(free):])


def test_a_bad_spec_is_a_value_error_naming_the_field(llm):
    with pytest.raises(StructuredOutputsError, match=r"^json: invalid JSON schema"):
        _so(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: invalid regex"):
        SamplingParams(structured_outputs={"regex": "(unclosed"})
    with pytest.raises(ValueError, match=r"^structured_outputs: unknown field 'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match=r"^structured_outputs: must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs='{"type": "object"}')
    with pytest.raises(ValueError, match=r"^grammar: invalid EBNF"):
        llm.generate(["hi"], SamplingParams(structured_outputs=_so(grammar="root ::= ")), use_tqdm=False)
    # the engine serves on after a refusal
    out = llm.generate(["hi"], SamplingParams(max_tokens=3, structured_outputs=_so(choice=["ok"])), use_tqdm=False)
    assert out[0].outputs[0].text == "ok"


def test_a_model_without_a_tokenizer_refuses_structured_output(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=128)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    bare = LLM(str(tmp_path), kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match=r"^structured_outputs: .*tokenizer"):
        bare.generate([[1, 2, 3]], SamplingParams(structured_outputs=_so(regex="a+")), use_tqdm=False)
    assert bare.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_preemption_keeps_each_grammar_state(llm):
    """Preempted by recompute, a sequence keeps its output tokens and so its grammar state: the answers are
    the ones an engine with room for every sequence gives."""
    small = LLM(kv_cache_memory=6 << 20)  # 8 blocks of 16 tokens for 6 sequences of ~60 tokens
    prompts = [_chat(f"Person number {i} as JSON, please.") for i in range(6)]
    ps = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=_so(json=SCHEMAS[0])) for _ in prompts]
    got = small.chat(prompts, ps, use_tqdm=False)
    assert small.engine.get_stats().num_preemptions_total > 0
    for o in got:
        assert o.error is None and o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS[0])
    assert _summary(got) == _summary(llm.chat(prompts, ps, use_tqdm=False))
