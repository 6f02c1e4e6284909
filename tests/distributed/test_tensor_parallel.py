"""Tensor parallelism over real torch.distributed (gloo, 2 processes on 127.0.0.1, 1 thread each): tiny random
llama-, qwen2- and qwen3-shaped HF checkpoints, each rank loading its shard through the declarative weight map,
against the same checkpoint on one process (TP=1): logits of a batched prefill and 4 greedy decode steps
through the paged KV cache within 1e-5, greedy tokens identical, on both ranks.

The shapes cover: kv-head replication (llama, 1 kv head on 2 ranks), a vocabulary that does not divide
(qwen2, 251 rows: the last rank's padding rows), a tied head (llama) and an untied one, biased qkv (qwen2),
q/k norms with head_dim != hidden / heads (qwen3), and the decode fusions of a GPU's plan (one-row linears,
pre-norms inside the projections, rope in attention; served here by the fused ops' reference
implementations) at batch 1 under TP=2 against the unfused TP=1 model."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import transformers

import tp_ranks  # noqa: E402  (tests/distributed is on sys.path, as pytest puts a test file's directory)
from turnout.distributed import SINGLE, free_port
from turnout.layers.embedding import LMHead, VocabEmbedding
from turnout.layers.linear import RowParallelLinear
from turnout.ops import resolve
from turnout.ops.reference import collectives
from turnout.platforms.detect import detect_platform

WORLD = 2
STEPS = 4


def _config(kind: str):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, rms_norm_eps=1e-6)
    if kind == "llama":  # one kv head on two ranks: replicated; tied head; biases everywhere
        return transformers.LlamaConfig(**common, vocab_size=256, num_key_value_heads=1, tie_word_embeddings=True,
                                        attention_bias=True, mlp_bias=True)
    if kind == "llama-kv2":  # two kv heads on four ranks: each rank holds one, rank r the head r // 2
        return transformers.LlamaConfig(**common, vocab_size=256, num_key_value_heads=2, tie_word_embeddings=False)
    if kind == "qwen2":  # biased q/k/v; a vocabulary of 251 rows splits as 126 + 125 (+1 padding row)
        return transformers.Qwen2Config(**common, vocab_size=251, num_key_value_heads=2, tie_word_embeddings=False)
    if kind == "qwen3":  # q/k norms, head_dim 32 != 64 / 4
        return transformers.Qwen3Config(**common, vocab_size=256, num_key_value_heads=2, head_dim=32,
                                        tie_word_embeddings=False)
    raise AssertionError(kind)


def _save_random(kind: str, path, seed: int) -> None:
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF starts biases at 0 and norms at 1: random values make every parameter count
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.05
            p.copy_((1.0 + 2 * noise) if "norm" in name else 2 * noise)
    hf.save_pretrained(path, safe_serialization=True)


def _prompts(vocab: int, lens, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    """Save the checkpoints, run both ranks once over every case, and the same cases on one process."""
    root = tmp_path_factory.mktemp("tp")
    cases = []
    for seed, kind in enumerate(("llama", "qwen2", "qwen3")):
        path = root / kind
        _save_random(kind, path, seed)
        cases.append((kind, str(path), _prompts(_config(kind).vocab_size, [5, 17, 9], seed), STEPS, False))
    cases.append(("qwen3-fused-batch1", str(root / "qwen3"), _prompts(256, [11], 7), STEPS, True))
    torch.set_num_threads(1)
    ops = resolve(detect_platform("cpu"))
    ranks = _run_world(WORLD, cases, root / "out", lambda: None)
    single = {name: tp_ranks.run_case(path, prompts, steps, ops) for name, path, prompts, steps, _ in cases}
    return single, ranks


def _run_world(world: int, cases, outdir, meanwhile):
    """Spawn ``world`` ranks over ``cases``; runs ``meanwhile()`` here while they work; each rank's results."""
    outdir.mkdir()
    ctx = mp.spawn(tp_ranks.rank_main, args=(world, free_port(), cases, str(outdir)), nprocs=world, join=False)
    meanwhile()
    while not ctx.join(timeout=120):
        pass
    return [torch.load(outdir / f"rank{r}.pt") for r in range(world)]


def _assert_matches(name, ref, ranks):
    ref_logits, ref_tokens = ref
    for r, result in enumerate(ranks):
        logits, tokens = result["cases"][name]
        assert logits.shape == ref_logits.shape, f"rank {r}"
        rel = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
        assert rel < 1e-5, f"rank {r}: logits differ from TP=1 by {rel:.3g} (relative)"
        assert torch.equal(tokens, ref_tokens), f"rank {r}: greedy tokens differ from TP=1"


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen3-fused-batch1"])
def test_tp2_matches_tp1(world_results, name):
    single, ranks = world_results
    assert single[name][0].shape[-1] == (251 if name == "qwen2" else 256)
    _assert_matches(name, single[name], ranks)


def test_tp4_replicates_distinct_kv_heads(tmp_path):
    """Four ranks, two kv heads: ranks 0, 1 hold kv head 0 and ranks 2, 3 kv head 1 (a wrong pick of head
    shows in the logits); every dim split four ways."""
    _save_random("llama-kv2", tmp_path / "m", 5)
    cases = [("llama-kv2", str(tmp_path / "m"), _prompts(256, [6, 13], 5), 2, False)]
    torch.set_num_threads(1)
    single = {}
    ranks = _run_world(4, cases, tmp_path / "out", lambda: single.update(
        ref=tp_ranks.run_case(*cases[0][1:4], resolve(detect_platform("cpu")))))
    _assert_matches("llama-kv2", single["ref"], ranks)


def test_collectives_over_gloo(world_results):
    _, ranks = world_results
    for r, result in enumerate(ranks):
        assert all(result["collectives"].values()), f"rank {r}: {result['collectives']}"


def test_collectives_in_a_world_of_one_are_the_identity():
    """What `turnout ops --check` runs on one process: every sample case of every collective."""
    gen = torch.Generator().manual_seed(0)
    for spec in (collectives.ALL_REDUCE, collectives.ALL_GATHER, collectives.REDUCE_SCATTER, collectives.ALL_TO_ALL):
        for case in spec.sample_inputs("cpu", torch.float32, gen):
            x = case.args[0]
            before = x.clone()
            assert torch.equal(spec.reference(*case.args, **case.kwargs), before), (spec.name, case.label)


class _NoCollectives:
    """An op table whose collectives fail: a TP=1 model must never call one."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        if name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            raise AssertionError(f"a world of one called {name}")
        return getattr(self._ops, name)


def test_tp1_is_the_single_device_model(tmp_path):
    """Built with SINGLE (the default) the model holds the full tensors and makes no collective call."""
    from turnout.loader import load_model

    _save_random("qwen2", tmp_path, 0)
    ops = _NoCollectives(resolve(detect_platform("cpu")))
    loaded = load_model(str(tmp_path), device="cpu", ops=ops)
    model = loaded.model
    assert model.tp is SINGLE and model.model.embed_tokens.weight.shape == (251, 64)
    for m in model.modules():
        if isinstance(m, RowParallelLinear):
            assert m.reduce_ops is None
        if isinstance(m, VocabEmbedding):
            assert m.reduce_ops is None
        if isinstance(m, LMHead):
            assert m.gather_ops is None
    logits, tokens = tp_ranks.greedy_run(model, loaded.hf_config, _prompts(251, [5, 9], 0), 2)
    assert logits.shape == (14 + 2 * 2, 251) and tokens.shape == (2, 3)

