"""Speculative decoding keeps the target's distribution and every sampling behaviour, on a tiny random Qwen3
(peaked logits, so drafts are often right and the acceptance path is exercised, not only the rejection one).

The statistical test: 2000 seeded samples of the tokens drawn at draft positions 0 and 1 of the first
multi-token step, with n-gram speculation, against the exact marginals computed by HF transformers on the same
weights (sum over the tokens before them of the products of their conditionals). A chi-square test on bins of
expected count >= 5 must not reject at significance 1e-4 (the critical value by Wilson-Hilferty); the seeds
are fixed, so the test is deterministic. Keeping every draft whatever the draws (the acceptance rule
mutated in worker/step_sampling.py) fails it: a statistic of ~4500 against the bound's ~96 at the second
position, whose draw then conditions on a rejected draft."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402

V = 64
T = 0.7
N = 2000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger weights than the init's: peaked next-token distributions
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.05
            p.copy_((1.0 + 2 * noise) if "norm" in name else 4 * noise)
        prompt = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=60, do_sample=False)[0].tolist()
    d = tmp_path_factory.mktemp("qwen3_speculative")
    hf.save_pretrained(d, safe_serialization=True)
    return str(d), hf, prompt  # the prompt: the model's own greedy text, so its n-grams predict it


@pytest.fixture(scope="module")
def llm(tiny):
    path, _, _ = tiny
    llm = LLM(path, kv_cache_memory=16 << 20, async_scheduling=False, max_num_seqs=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    yield llm
    llm.shutdown()


def _run(llm, prompts, params):
    before = llm.get_stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.get_stats()
    return (outs, after.draft_tokens_total - before.draft_tokens_total,
            after.accepted_draft_tokens_total - before.accepted_draft_tokens_total)


def _off(p):
    return dataclasses.replace(p, speculative_decoding=False)


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty: the chi-square quantile with ``df`` degrees of freedom at the normal quantile z
    (3.719: significance 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """The statistic and its degrees of freedom, bins of expected count < 5 merged into one."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


@torch.no_grad()
def _exact_marginals(hf, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """p(t1) and p(t2) after ``prompt`` at temperature T, summed over the tokens before them (HF transformers)."""
    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        return torch.softmax(hf(prefixes).logits[:, -1].double() / T, -1)

    base = torch.tensor([prompt])
    p0 = next_probs(base)[0]  # [V]
    one = torch.cat([base.repeat(V, 1), torch.arange(V)[:, None]], 1)
    p1 = next_probs(one)  # [t0, t1]
    two = torch.cat([one.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
    p2 = next_probs(two).reshape(V, V, V)  # [t0, t1, t2]
    joint01 = p0[:, None] * p1
    return joint01.sum(0), (joint01[:, :, None] * p2).sum((0, 1))


def test_sampled_distribution_equals_the_targets(llm, tiny):
    _, hf, prompt = tiny
    # max_tokens 4: the first decode step verifies two drafts (t1, t2), then draws its last token
    params = [SamplingParams(temperature=T, seed=s, max_tokens=4, ignore_eos=True) for s in range(N)]
    got, drafted, accepted = _run(llm, [prompt] * N, params)
    assert drafted > N and accepted > 0.1 * drafted, (drafted, accepted)  # both paths well exercised
    toks = torch.tensor([o.outputs[0].token_ids for o in got])
    m1, m2 = _exact_marginals(hf, prompt)
    for pos, exact in ((1, m1), (2, m2)):
        counts = torch.bincount(toks[:, pos], minlength=V).double()
        stat, df = _chi2(counts, exact)
        assert df >= 2 and stat < _chi2_critical(df), (pos, stat, df, _chi2_critical(df))
    # and seed by seed, the very samples drawn without speculation
    want, drafted_off, _ = _run(llm, [prompt] * 300, [_off(p) for p in params[:300]])
    assert drafted_off == 0 and _summary(got[:300]) == _summary(want)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=20, min_p=0.01, seed=5, max_tokens=30, logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.2, presence_penalty=0.4,
                   frequency_penalty=0.2),
    SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12, stop_token_ids=[10, 58]),
    SamplingParams(n=3, temperature=0.9, seed=4, max_tokens=20, ignore_eos=True),
])
def test_every_sampling_behaviour_is_kept(llm, tiny, params):
    """Greedy, seeded top-p/top-k/min-p samples, penalties, max_tokens, min_tokens, stop tokens and n > 1 samples:
    as without drafts, token for token (logprobs up to the rounding of a wider GEMM)."""
    _, _, prompt = tiny
    prompts = [prompt, prompt[:20], [5, 9, 5, 9, 5, 9, 5]]
    want, _, _ = _run(llm, prompts, _off(params))
    got, drafted, _ = _run(llm, prompts, params)
    assert drafted > 0
    assert _summary(got) == _summary(want)
    if params.logprobs is not None:
        for g, w in zip(got, want):
            for eg, ew in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert set(eg) == set(ew) and all(abs(eg[t].logprob - ew[t].logprob) < 1e-4 for t in eg)


def test_counters(llm, tiny):
    _, _, prompt = tiny
    _run(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    s = llm.get_stats()
    assert s.num_drafts_total > 0 and s.draft_tokens_total >= s.accepted_draft_tokens_total > 0
    assert sum(s.draft_tokens_per_position) == s.draft_tokens_total
    assert sum(s.accepted_draft_tokens_per_position) == s.accepted_draft_tokens_total
    assert s.draft_tokens_per_position[0] == s.num_drafts_total
    assert s.mean_accepted_length == 1 + s.accepted_draft_tokens_total / s.num_drafts_total
    # a draft is kept only after the one before it: acceptance counts fall with the position
    acc = s.accepted_draft_tokens_per_position
    assert all(a >= b for a, b in zip(acc, acc[1:]))


def test_the_model_as_its_own_draft(tiny):
    """The draft-model method with the target's own checkpoint: greedy and sampled output identical, every draft
    accepted."""
    path, _, prompt = tiny
    llm = LLM(path, kv_cache_memory=16 << 20, async_scheduling=False,
              speculative_config={"model": path, "num_speculative_tokens": 4})
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1)
    prompts = [prompt[:10], [7, 8, 9]]
    want, _, _ = _run(llm, prompts, _off(sp))
    got, drafted, accepted = _run(llm, prompts, sp)
    assert _summary(got) == _summary(want)
    assert drafted > 0 and accepted == drafted
    assert llm.get_stats().mean_accepted_length > 4.0  # 5 but where max_tokens cut the last drafts
    # sampled: the draft draws with the target's seed and output steps, so the same noise: every draft kept
    for sp in (SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
               SamplingParams(temperature=1.0, top_k=8, top_p=0.9, seed=2, max_tokens=30, ignore_eos=True,
                              repetition_penalty=1.1)):
        want, _, _ = _run(llm, prompts, _off(sp))
        got, drafted, accepted = _run(llm, prompts, sp)
        assert _summary(got) == _summary(want) and drafted > 0 and accepted == drafted, (accepted, drafted)
    llm.shutdown()


def test_bench_reports_the_drafts(tiny, tmp_path, capsys):
    """`turnout bench latency --speculative-config '{json}'`: the JSON's ``speculative`` entry and the table line."""
    import json

    from turnout.entrypoints.cli import main as cli_main

    path, _, _ = tiny
    out = tmp_path / "lat.json"
    rc = cli_main(["--log-level", "WARNING", "bench", "latency", "--model", path, "--device", "cpu",
                   "--input-len", "8", "--output-len", "12", "--batch-size", "2", "--num-iters", "1",
                   "--num-iters-warmup", "0", "--kv-cache-memory", str(8 << 20), "--speculative-config",
                   '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}',
                   "--output-json", str(out)])
    assert rc == 0
    sp = json.loads(out.read_text())["speculative"]
    assert sp["method"] == "ngram" and sp["num_speculative_tokens"] == 2
    assert sp["num_draft_tokens"] >= sp["num_accepted_tokens"] >= 0 and sp["num_drafts"] >= 0
    assert "speculative: ngram k=2" in capsys.readouterr().out


def test_async_scheduling_between_drafted_steps(tiny):
    """With async scheduling, a step without drafts is followed by a lookahead step and the step after it asks
    the proposer again: the output is still that of no speculation, with both lookaheads and kept drafts."""
    path, _, prompt = tiny
    llm = LLM(path, kv_cache_memory=16 << 20, async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                  "prompt_lookup_max": 3})
    prompts = [prompt[:12], prompt, [5, 9, 5, 9, 5, 9, 5], [33, 1, 7]]
    for sp in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
               SamplingParams(temperature=0.9, seed=8, max_tokens=40, ignore_eos=True, logprobs=1)):
        want, _, _ = _run(llm, prompts, _off(sp))
        before = llm.engine.num_lookahead_steps
        got, drafted, accepted = _run(llm, prompts, sp)
        assert _summary(got) == _summary(want)
        assert llm.engine.num_lookahead_steps > before and drafted > 0
        if sp.temperature == 0.0:
            assert accepted > 0
    llm.shutdown()
