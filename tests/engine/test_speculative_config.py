"""speculative_config, as vLLM spells it: LLM(speculative_config={...}) and --speculative-config '{json}' reach
the same checked settings, and every mistake is a ValueError naming speculative_config.<field> before a model
is loaded. The n-gram proposer's incremental index agrees with a plain scan of the context."""

from __future__ import annotations

import random

import pytest

from turnout.config import EngineConfig
from turnout.engine.ngram_proposer import NgramProposer
from turnout.engine.sampling_params import SamplingParams
from turnout.engine.sequence import Sequence
from turnout.entrypoints import cli
from turnout.entrypoints.openai import serve_cmd
from turnout.speculative_config import SpeculativeConfig


def test_ngram_and_draft_model_settings():
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                         "prompt_lookup_max": 4})
    assert c.speculative == SpeculativeConfig("ngram", 3, 2, 4)
    assert c.num_speculative_tokens == 3  # the decode graphs' query lengths follow k
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).speculative == \
        SpeculativeConfig("ngram", 2, 5, 5)  # vLLM's defaults
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_max": 3}).speculative.prompt_lookup_min == 3
    d = EngineConfig(speculative_config={"model": "/some/draft", "num_speculative_tokens": 4}).speculative
    assert (d.method, d.model, d.num_speculative_tokens) == ("draft_model", "/some/draft", 4)
    s = EngineConfig(speculative_config={"num_draft_layers": 2, "num_speculative_tokens": 3}).speculative
    assert (s.method, s.model, s.num_draft_layers) == ("draft_model", None, 2)  # the target's own first layers
    m = EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 3}).speculative
    assert (m.method, m.model, m.num_speculative_tokens) == ("mtp", None, 3)  # the target's own MTP layer
    e = EngineConfig(speculative_config={"method": "eagle3", "model": "/some/head", "num_speculative_tokens": 2})
    assert (e.speculative.method, e.speculative.model) == ("eagle3", "/some/head")
    assert EngineConfig().speculative is None and EngineConfig().num_speculative_tokens == 0
    # the legacy option alone still sizes the graphs, with no proposer
    assert EngineConfig(num_speculative_tokens=2).speculative is None


def test_the_flag_takes_vllms_json():
    for cmd in (["serve"], ["generate", "hi"], ["bench", "latency"]):
        args = cli.build_parser().parse_args(
            cmd + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'])
        assert args.speculative_config.startswith("{")
    config = serve_cmd.build_config(cli.build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']))
    assert config.speculative == SpeculativeConfig("ngram", 2, 5, 5)


@pytest.mark.parametrize("value,field,why", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method", "not built in turnout"),
    ({"method": "medusa", "num_speculative_tokens": 1}, "method", "not built in turnout"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "model", "EAGLE-3 head's directory"),
    ({"method": "mtp", "num_speculative_tokens": 1, "model": "x"}, "model", "give no model"),
    ({"method": "mtp", "num_speculative_tokens": 1, "num_draft_layers": 1}, "num_draft_layers", "only for"),
    ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 2}, "prompt_lookup_max", "only for"),
    ({"method": "lookahead", "num_speculative_tokens": 2}, "method", "unknown method"),
    ({"num_speculative_tokens": 2}, "method", "required"),
    ({"method": "ngram"}, "num_speculative_tokens", "required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens", r"in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens", r"in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens", r"in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min", "must not exceed"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max", ">= 1|in"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model", "no model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model", "needs the draft"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max", "only for"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_vocab": 3}, "draft_vocab", "unknown field"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size", ">= 1"),
    ({"num_draft_layers": 0, "num_speculative_tokens": 2}, "num_draft_layers", ">= 1"),
    ({"method": "ngram", "num_draft_layers": 2, "num_speculative_tokens": 2}, "num_draft_layers", "only for"),
    ("{not json", "", "not valid JSON"),
    (["ngram"], "", "must be a dict"),
])
def test_bad_settings_name_the_field(value, field, why):
    name = f"speculative_config.{field}" if field else "speculative_config"
    with pytest.raises(ValueError, match=f"^{name}: .*({why})"):
        EngineConfig(speculative_config=value)


def test_two_values_of_k_are_refused():
    with pytest.raises(ValueError, match="^num_speculative_tokens: 3 differs"):
        EngineConfig(num_speculative_tokens=3, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_missing_draft_is_refused_at_start_up():
    from turnout import LLM

    with pytest.raises(ValueError, match="^speculative_config.model: '/no/such/draft' does not exist"):
        LLM(speculative_config={"model": "/no/such/draft", "num_speculative_tokens": 2})


def test_per_request_switch_is_checked():
    assert SamplingParams().speculative_decoding is True
    with pytest.raises(ValueError, match="^speculative_decoding: must be a boolean"):
        SamplingParams(speculative_decoding=1)


def _naive(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition: for the longest n in [lo, hi], the k tokens after the latest earlier occurrence of the
    last n tokens (a scan of the whole context)."""
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_index_equals_a_scan_of_the_context():
    rng = random.Random(0)
    for lo, hi, k, vocab in ((1, 3, 4, 5), (2, 5, 3, 3), (3, 3, 2, 4), (1, 1, 5, 8)):
        prop = NgramProposer(k, lo, hi)
        seq = Sequence(0, "r", [rng.randrange(vocab) for _ in range(7)], None, seed=0)
        for _ in range(120):  # grow the context a token or a few at a time, as accepted drafts do
            got = prop.propose([seq]).get(0, [])
            assert got == _naive(seq.token_ids, k, lo, hi), (lo, hi, k, seq.token_ids)
            for _ in range(rng.choice((1, 1, 3))):
                seq.append_token(rng.randrange(vocab))


def test_ngram_copies_what_followed():
    prop = NgramProposer(3, 1, 3)
    seq = Sequence(0, "r", [9, 1, 2, 3, 4, 5, 7, 1, 2], None, seed=0)
    assert prop.propose([seq]) == {0: [3, 4, 5]}
    seq.append_token(8)  # "1 2 8" never occurred, nor "2 8", nor "8"
    assert prop.propose([seq]) == {}


def test_counters_reach_metrics_and_bench_json():
    """EngineStats' draft counters -> /metrics' spec_decode families and `turnout bench`'s JSON."""
    from prometheus_client.core import CounterMetricFamily

    from turnout.engine.core_outputs import EngineStats
    from turnout.engine.drafts import DraftCounts
    from turnout.entrypoints.bench_cmd import speculative_report
    from turnout.entrypoints.openai.metrics import _speculative_metrics

    counts = DraftCounts()
    for drafted, kept in ((3, 3), (3, 1), (2, 0)):
        counts.add(drafted, kept)
    s = EngineStats(**counts.stats())
    assert (s.num_drafts_total, s.draft_tokens_total, s.accepted_draft_tokens_total) == (3, 8, 4)
    assert s.draft_tokens_per_position == [3, 3, 2] and s.accepted_draft_tokens_per_position == [2, 1, 1]
    assert s.mean_accepted_length == 1 + 4 / 3 and s.draft_acceptance_per_position == [2 / 3, 1 / 3, 1 / 2]

    def counter(name, doc, value):
        m = CounterMetricFamily(name, doc)
        m.add_metric([], value)
        return m

    fams = {m.name: m for m in _speculative_metrics(s, counter)}
    assert fams["turnout_spec_decode_num_accepted_tokens"].samples[0].value == 4
    per = fams["turnout_spec_decode_num_accepted_tokens_per_pos"].samples
    assert [(x.labels["position"], x.value) for x in per] == [("0", 2), ("1", 1), ("2", 1)]
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    rep = speculative_report(config, s)
    assert rep["method"] == "ngram" and rep["num_accepted_tokens"] == 4 and rep["mean_accepted_length"] == 1 + 4 / 3
    assert speculative_report(EngineConfig(), s) is None


def test_the_server_field_reaches_the_request():
    from turnout.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from turnout.entrypoints.openai.serving import _sampling_params

    for req, want in ((CompletionRequest(prompt="hi", speculative_decoding=False), False),
                      (ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), True)):
        assert _sampling_params(req, max_tokens=4, logprobs=None, rename={}).speculative_decoding is want
