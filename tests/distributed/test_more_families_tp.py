"""ERNIE-4.5 dense and MoE and Phi-3 under tensor parallelism (gloo, 2 processes on 127.0.0.1, 1 thread each):
a batched prefill of 3 prompts and STEPS greedy decode steps on both ranks against the same checkpoint on one
process (TP=1): every step's logits within 1e-5, tokens identical.

ERNIE dense with biases on every projection and interleaved rope, also at batch 1 with a GPU's decode fusions;
Phi-3, whose checkpoint stores q/k/v and gate/up packed (each rank cuts its share of every part out of the
packed tensor), with a window and rope on half of each head; Phi-3 with LongRoPE on prompts past the original
length; ERNIE MoE (aux-free biased routing, shared experts, dense layers around the MoE range) split by the
intermediate dim (TP) and by expert id (EP), the latter also with the decode fusions. The TP=1 models equal
transformers (tests/models/test_more_families_vs_hf.py). Gemma 2 / 3 and windowed Mistral:
tests/distributed/test_composed_families_tp.py."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import transformers

import moe_ranks  # noqa: E402  (tests/distributed is on sys.path, as pytest puts a test file's directory)
from turnout.distributed import free_port
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

WORLD, STEPS, VOCAB = 2, 20, 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-6, num_hidden_layers=2)
# name -> (checkpoint, expert parallel, decode fusions at batch 1)
CASES = {
    "ernie": ("ernie", False, False),
    "ernie-fused-batch1": ("ernie", False, True),
    "phi3": ("phi3", False, False),
    "phi3_longrope": ("phi3_longrope", False, False),
    "ernie_moe": ("ernie_moe", False, False),
    "ernie_moe-ep": ("ernie_moe", True, False),
    "ernie_moe-ep-fused-batch1": ("ernie_moe", True, True),
}


def _config(kind: str):
    if kind == "ernie":
        return transformers.Ernie4_5Config(**COMMON, head_dim=16, use_bias=True)
    if kind == "ernie_moe":  # dense, sparse, sparse, dense
        return transformers.Ernie4_5_MoeConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, moe_num_experts=8,
                                               moe_k=3, moe_intermediate_size=32, moe_num_shared_experts=2,
                                               moe_layer_start_index=1, moe_layer_end_index=2,
                                               tie_word_embeddings=False)
    if kind == "phi3":
        return transformers.Phi3Config(**COMMON, sliding_window=8, pad_token_id=0,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                        "partial_rotary_factor": 0.5})
    if kind == "phi3_longrope":
        gen = torch.Generator().manual_seed(11)
        return transformers.Phi3Config(
            **COMMON, pad_token_id=0, original_max_position_embeddings=16,
            rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 16,
                             "short_factor": (1 + torch.rand(8, generator=gen)).tolist(),
                             "long_factor": (2 + 8 * torch.rand(8, generator=gen)).tolist()})
    raise AssertionError(kind)


def _save_random(kind: str, path, seed: int) -> None:
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms 1 + noise, a correction bias that changes the choice, decisive routing
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 1.5 * p.shape[-1] ** -0.5))
    hf.save_pretrained(path, safe_serialization=True)


def _prompts(name: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lens = (11,) if name.endswith("batch1") else (20, 33, 17) if "longrope" in name else (5, 17, 9)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_more")
    for seed, kind in enumerate(dict.fromkeys(kind for kind, _, _ in CASES.values())):
        _save_random(kind, root / kind, seed)
    cases = [(name, str(root / kind), _prompts(name, i), STEPS, "auto", ep, fused)
             for i, (name, (kind, ep, fused)) in enumerate(CASES.items())]
    torch.set_num_threads(1)
    (root / "out").mkdir()
    ctx = mp.spawn(moe_ranks.rank_main, args=(WORLD, free_port(), cases, str(root / "out")), nprocs=WORLD, join=False)
    ops = resolve(detect_platform("cpu"))
    single = {name: moe_ranks.run_case(path, prompts, steps, ops) for name, path, prompts, steps, *_ in cases}
    while not ctx.join(timeout=120):
        pass
    return single, [torch.load(root / "out" / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_matches_tp1(world, name):
    single, ranks = world
    ref_logits, ref_tokens, ref_shapes = single[name]
    assert len(set(ref_tokens.flatten().tolist())) > STEPS // 4  # a varied continuation: equal tokens say something
    for r, result in enumerate(ranks):
        logits, tokens, shapes = result[name]
        assert logits.shape == ref_logits.shape, f"rank {r}"
        rel = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
        assert rel < 1e-5, f"{name} rank {r}: logits differ from TP=1 by {rel:.3g} (relative)"
        assert torch.equal(tokens, ref_tokens), f"{name} rank {r}: greedy tokens differ from TP=1"
        for (gu, down, start), (full_gu, full_down, _) in zip(shapes, ref_shapes, strict=True):
            if CASES[name][1]:  # EP: half the experts, whole
                assert gu == (full_gu[0] // 2, *full_gu[1:]) and start == r * full_gu[0] // 2
            else:  # TP: every expert, half its intermediate dim
                assert gu == (full_gu[0], full_gu[1] // 2, full_gu[2]) and down == (*full_down[:2], full_down[2] // 2)
    assert bool(ref_shapes) == name.startswith("ernie_moe")


KW = dict(device="cpu", kv_cache_memory=4 << 20, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)


def _held_experts(worker):
    return [start for _, _, start in moe_ranks.expert_shapes(worker.loaded.model)]


@pytest.mark.parametrize("kind", ["ernie_moe", "phi3"])
def test_llm_two_ranks_match_one_rank(kind, tmp_path):
    """The whole engine with two ranks (the mp executor; ERNIE MoE splitting its experts by id, Phi-3 cutting its
    packed tensors per rank) against one rank: greedy tokens and logprobs through 16-token prefill chunks and
    prefix-cache hits."""
    from turnout import LLM, SamplingParams

    _save_random(kind, tmp_path, 5)
    shared = _prompts(kind, 6)[1]  # 17 tokens, a prefix of the first two prompts
    batch = [shared + [1, 2, 3], shared + [4], _prompts(kind, 7)[0], [7]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)

    def run(llm):
        outs = llm.generate(batch, params, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                [[lp[t] if isinstance(lp[t], float) else lp[t].logprob for lp, t in
                  zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])

    ref_tokens, ref_lps = run(LLM(str(tmp_path), **KW))
    llm = LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=kind == "ernie_moe", **KW)
    try:
        tokens, lps = run(llm)
        held = llm.engine.executor.collective_rpc(_held_experts)
    finally:
        llm.engine.executor.shutdown()
    # ERNIE: two sparse layers (0 and 3 dense), each rank half of 8 experts
    assert held == ([[0, 0], [4, 4]] if kind == "ernie_moe" else [[], []])
    assert tokens == ref_tokens
    for a, b in zip(lps, ref_lps, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
