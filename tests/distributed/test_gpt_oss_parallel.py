"""GPT-OSS under tensor and expert parallelism over real torch.distributed (gloo, 2 processes on 127.0.0.1): a tiny
random checkpoint (sinks split by head, biased q/k/v/o, windows of 6 on alternate layers, the biased router
replicated, the clamped-SwiGLU experts split by their intermediate dim under TP, with the down bias added on one
rank only, or by expert id under EP), a batched prefill of 3 prompts and STEPS greedy steps on both ranks, against
the same checkpoint on one process (TP=1) and against transformers on the prompts plus the tokens generated. Also
at batch 1 with every decode fusion of a GPU's plan (the fused ops' reference implementations)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import transformers

import moe_ranks  # noqa: E402  (tests/distributed is on sys.path, as pytest puts a test file's directory)
from turnout.distributed import TPGroup, free_port
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

WORLD = 2
STEPS = 24  # several windows of 6, across a KV block
# name -> (expert parallel, decode fusions at batch 1)
CASES = {"tp": (False, False), "ep": (True, False), "tp-fused-batch1": (False, True), "ep-fused-batch1": (True, True)}


def _config():
    return transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
        max_position_embeddings=128, swiglu_limit=3.0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32, "rope_theta": 150000.0})


def _build_hf(seed: int = 0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 0.6 if "gate_up" in name else 0.2 if "experts" in name else 1.0 if "sinks" in name else 0.1
            noise = scale * torch.randn(p.shape, generator=gen)
            p.copy_(p + noise if "norm" in name else noise)
    return hf


def _prompts(seed: int, lens):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]


def _hf_logits(model, prompts, tokens):
    """transformers' logits in greedy_run's row order: each prompt's prefill rows, then one row per prompt a step."""
    with torch.no_grad():
        per_prompt = [model(torch.tensor([p + tokens[b, :STEPS].tolist()])).logits[0] for b, p in enumerate(prompts)]
    rows = [per_prompt[b][:len(p)] for b, p in enumerate(prompts)]
    rows += [torch.stack([per_prompt[b][len(p) + s] for b, p in enumerate(prompts)]) for s in range(STEPS)]
    return torch.cat(rows).float()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_tp")
    hf = _build_hf()
    hf.save_pretrained(root / "ckpt", safe_serialization=True)
    cases = [(name, str(root / "ckpt"), _prompts(i, (11,) if fused else (5, 17, 9)), STEPS, "auto", ep, fused)
             for i, (name, (ep, fused)) in enumerate(CASES.items())]
    torch.set_num_threads(1)
    (root / "out").mkdir()
    ctx = mp.spawn(moe_ranks.rank_main, args=(WORLD, free_port(), cases, str(root / "out")), nprocs=WORLD, join=False)
    ops = resolve(detect_platform("cpu"))
    single = {name: moe_ranks.run_case(path, prompts, steps, ops) for name, path, prompts, steps, *_ in cases}
    theirs = {name: _hf_logits(hf, prompts, single[name][1]) for name, _, prompts, *_ in cases}
    while not ctx.join(timeout=120):
        pass
    ranks = [torch.load(root / "out" / f"rank{r}.pt") for r in range(WORLD)]
    return single, theirs, ranks


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_match_one_and_transformers(world, name):
    single, theirs, ranks = world
    ref_logits, ref_tokens, _ = single[name]
    assert _rel(ref_logits, theirs[name]) < 1e-5, "TP=1 against transformers"
    assert len(set(ref_tokens.flatten().tolist())) > 4, "a varied continuation, so equal tokens say something"
    for r, result in enumerate(ranks):
        logits, tokens, _ = result[name]
        rel = _rel(logits, ref_logits)
        assert rel < 1e-5, f"{name} rank {r}: logits differ from TP=1 by {rel:.3g} (relative)"
        assert torch.equal(tokens, ref_tokens), f"{name} rank {r}: greedy tokens differ from TP=1"


@pytest.mark.parametrize("ep", [False, True])
def test_what_each_rank_holds(ep):
    """Half of every expert's intermediate dim (TP) or half the experts whole (EP); sinks split by head; the down
    bias added by one rank of an intermediate split, by every rank holding whole experts."""
    from turnout.models.registry import get_model_class

    cls = get_model_class(["GptOssForCausalLM"])
    ops = resolve(detect_platform("cpu"))
    for rank in range(WORLD):
        with torch.device("meta"):
            model = cls(_config(), ops, tp=TPGroup(rank=rank, size=WORLD, group=object()), expert_parallel=ep)
        experts = model.model.layers[0].mlp.experts
        if ep:
            assert tuple(experts.gate_up_proj.shape) == (4, 64, 64) and experts.expert_start == 4 * rank
            assert tuple(experts.down_proj_bias.shape) == (4, 64) and experts.adds_down_bias
        else:
            assert tuple(experts.gate_up_proj.shape) == (8, 32, 64) and tuple(experts.down_proj.shape) == (8, 64, 16)
            assert experts.adds_down_bias == (rank == 0)
        assert tuple(model.model.layers[0].self_attn.attn.sinks.shape) == (2,)
