"""The composed decoder's parts under tensor parallelism (gloo, 2 processes): tiny Gemma 2 (sandwich (1 + w) norms,
scaled embeddings, soft-caps, windows on alternate layers, a tied head), Gemma 3 (per-head (1 + w) q/k norms, rope
per layer type) and Mistral (a window on every layer), each generating greedily well past its window, TP=2 on both
ranks against TP=1 on one process: every step's logits within 1e-5, tokens identical. Gemma 3 also runs at batch 1
with a GPU's decode fusions (pre-norms inside the projections, rope and the window inside attention). The TP=1
models equal transformers' (tests/models/test_composed_families_vs_hf.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

import tp_ranks  # noqa: E402  (tests/distributed is on sys.path, as pytest puts a test file's directory)
from test_tensor_parallel import _assert_matches, _prompts, _run_world  # noqa: E402
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

STEPS = 20  # past every window below, and across a KV block
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-6, head_dim=16)


def _config(kind: str):
    if kind == "gemma2":
        return transformers.Gemma2Config(**COMMON, num_hidden_layers=2, sliding_window=6, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                         tie_word_embeddings=True)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=2, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=8, tie_word_embeddings=False)
    raise AssertionError(kind)


def _save_random(kind: str, path, seed: int) -> None:
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms keep their initial value (Gemma's 0, others' 1) plus noise
        for name, p in hf.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(p + noise if "norm" in name else noise)
    hf.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_composed")
    cases = []
    for seed, kind in enumerate(("gemma2", "gemma3", "mistral")):
        _save_random(kind, root / kind, seed)
        cases.append((kind, str(root / kind), _prompts(256, [5, 17, 9], seed), STEPS, False))
    cases.append(("gemma3-fused-batch1", str(root / "gemma3"), _prompts(256, [11], 7), STEPS, True))
    torch.set_num_threads(1)
    ops = resolve(detect_platform("cpu"))
    ranks = _run_world(2, cases, root / "out", lambda: None)
    single = {name: tp_ranks.run_case(path, prompts, steps, ops) for name, path, prompts, steps, _ in cases}
    return single, ranks


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral", "gemma3-fused-batch1"])
def test_tp2_matches_tp1_past_the_window(world_results, name):
    single, ranks = world_results
    _assert_matches(name, single[name], ranks)
