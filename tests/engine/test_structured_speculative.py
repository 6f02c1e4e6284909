"""Speculative decoding of sequences under a grammar: a draft is cut where the grammar stops allowing it, each
verified position is masked by the grammar's state after the drafts before it, and the kept tokens are accepted
in order. The output equals the same constrained requests without speculation (greedy and seeded sampling, the
JSON valid against its schema), with drafts kept on a prompt that asks to copy JSON, on the embedded
SmolLM2-135M. The baseline is the request's ``speculative_decoding=False``."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("xgrammar")

from turnout import LLM, SamplingParams  # noqa: E402
from turnout.structured import StructuredOutputsParams  # noqa: E402
from turnout.structured.matcher import DraftedGrammarState, valid_draft_prefix  # noqa: E402

RECORD = {"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "languages": ["English", "French"]}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                           "field": {"type": "string"},
                                           "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "born", "field", "languages"], "additionalProperties": False}
COPY = f"Copy this JSON record exactly.\nRecord: {json.dumps(RECORD)}\nCopy: "


@pytest.fixture(scope="module")
def llm():
    engine = LLM(kv_cache_memory=64 << 20, async_scheduling=False,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                     "prompt_lookup_max": 3})
    yield engine
    engine.engine.executor.shutdown()


def _run(llm, prompts, params):
    before = llm.get_stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.get_stats()
    return ([[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs],
            after.draft_tokens_total - before.draft_tokens_total,
            after.accepted_draft_tokens_total - before.accepted_draft_tokens_total)


def _off(params):
    return [dataclasses.replace(p, speculative_decoding=False) for p in params]


def test_constrained_requests_with_drafts_equal_those_without(llm):
    so = StructuredOutputsParams(json=SCHEMA)
    prompts = [COPY, COPY, "Describe a famous scientist as JSON:"]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so),
              SamplingParams(temperature=0.8, seed=11, max_tokens=60, structured_outputs=so),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)]
    want, drafted_off, _ = _run(llm, prompts, _off(params))
    got, drafted, kept = _run(llm, prompts, params)
    assert drafted_off == 0
    assert got == want
    assert drafted > 0 and kept > 0, (drafted, kept)  # the copy prompt's drafts are verified and kept
    record = json.loads(got[0][0][1])  # the greedy copy is complete and valid under the schema
    assert set(record) == set(SCHEMA["required"]) and isinstance(record["born"], int)


def test_a_draft_is_cut_where_the_grammar_refuses_it(llm):
    from turnout.structured.compiler import GrammarCompiler

    tok = llm.get_tokenizer()
    state = GrammarCompiler(tok, llm.engine.runner.vocab_size).new_state(StructuredOutputsParams(json=SCHEMA))
    good = tok.encode('{"name": "Ada", "born": 18', add_special_tokens=False)  # inside an integer ...
    bad = tok.encode("x", add_special_tokens=False)  # ... where a letter is refused
    assert valid_draft_prefix(state, good + bad + good) == len(good)
    assert state.num_accepted == 0  # left as it was
    view = DraftedGrammarState(state, good)
    assert not view.is_terminated() and state.num_accepted == 0
    import torch

    after, before = torch.zeros(1, (llm.engine.runner.vocab_size + 31) // 32, dtype=torch.int32), None
    before = after.clone()
    view.fill_bitmask(after, 0)
    state.fill_bitmask(before, 0)
    assert state.num_accepted == 0 and not torch.equal(after, before)  # the row after the drafts is another mask
    brace = tok.encode("{", add_special_tokens=False)[0]
    bit = 1 << (brace % 32)
    assert before[0, brace // 32] & bit and not after[0, brace // 32] & bit  # '{' opens the text, not an integer
