"""MoE tensor and expert parallelism over real torch.distributed (gloo, 2 processes on 127.0.0.1, 1 thread each),
and dummy weights that do not depend on the tensor-parallel size.

Tiny random HF checkpoints of the four MoE families (qwen3_moe with a dense layer, qwen2_moe with its gated
shared expert, mixtral, glm4_moe with grouped sigmoid routing, the correction bias, a shared expert and a dense
first layer), each rank loading its shard through the declarative weight map from per-expert checkpoint
tensors: a batched prefill of 3 prompts and STEPS greedy decode steps through the paged KV cache, on both ranks,
against the same checkpoint on one process (TP=1) and against transformers on the prompt plus the tokens
generated. TP=2 splits every expert by its intermediate dim; EP=2 (qwen3_moe, glm4_moe) gives each rank half the
experts. The same with every decode fusion of a GPU's plan (one-row linears, pre-norms inside the qkv and
router projections, rope in attention; the fused ops' reference implementations) at batch 1 against the unfused
TP=1 model, under TP (qwen3_moe) and EP (glm4_moe: its float32 router). Dummy weights (load_format="dummy": a dense qwen3 with a padded vocabulary, qwen2_moe under EP,
glm4_moe under TP) give TP=2 logits equal to TP=1's. Then the whole engine: ``LLM(tensor_parallel_size=2,
enable_expert_parallel=True)`` against ``LLM()``."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import moe_ranks  # noqa: E402  (tests/distributed is on sys.path, as pytest puts a test file's directory)
from turnout.distributed import TPGroup, free_port
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

WORLD = 2
STEPS = 32
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
# name -> (checkpoint kind, load_format, expert parallel, decode fusions at batch 1)
CASES = {
    **{kind: (kind, "auto", False, False) for kind in FAMILIES},
    "qwen3_moe-ep": ("qwen3_moe", "auto", True, False),
    "glm4_moe-ep": ("glm4_moe", "auto", True, False),
    "qwen3_moe-fused-batch1": ("qwen3_moe", "auto", False, True),
    "glm4_moe-ep-fused-batch1": ("glm4_moe", "auto", True, True),
    "qwen3-dummy": ("qwen3", "dummy", False, False),
    "qwen2_moe-dummy-ep": ("qwen2_moe", "dummy", True, False),
    "glm4_moe-dummy": ("glm4_moe", "dummy", False, False),
}


def _prompts(vocab: int, seed: int, lens=(5, 17, 9)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Save the checkpoints, run both ranks once over every case, and meanwhile each case on one process and
    the checkpoints' transformers models."""
    root = tmp_path_factory.mktemp("moe_tp")
    hf = {}
    for kind in (*FAMILIES, "qwen3"):
        if kind == "qwen3":  # dummy only: a config is all it needs
            cfg = moe_ranks.config(kind)
            cfg.architectures = ["Qwen3ForCausalLM"]
            cfg.save_pretrained(root / kind)
        else:
            hf[kind] = moe_ranks.build_hf(kind)
            hf[kind].save_pretrained(root / kind, safe_serialization=True)
    cases = [(name, str(root / kind), _prompts(moe_ranks.config(kind).vocab_size, i, (11,) if fused else (5, 17, 9)),
              STEPS, fmt, ep, fused) for i, (name, (kind, fmt, ep, fused)) in enumerate(CASES.items())]
    torch.set_num_threads(1)
    (root / "out").mkdir()
    ctx = mp.spawn(moe_ranks.rank_main, args=(WORLD, free_port(), cases, str(root / "out")), nprocs=WORLD, join=False)
    ops = resolve(detect_platform("cpu"))
    single = {name: moe_ranks.run_case(path, prompts, steps, ops, None, fmt) for name, path, prompts, steps, fmt, *_ in
              cases}  # one rank, no fusions
    theirs = {name: _hf_logits(hf[CASES[name][0]], prompts, single[name][1]) for name, _, prompts, *_ in cases
              if CASES[name][1] != "dummy"}
    while not ctx.join(timeout=120):
        pass
    ranks = [torch.load(root / "out" / f"rank{r}.pt") for r in range(WORLD)]
    return {name: prompts for name, _, prompts, *_ in cases}, single, theirs, ranks


def _hf_logits(model, prompts, tokens):
    """transformers' logits over each prompt and the tokens generated after it, in greedy_run's row order:
    the prefill rows of every prompt, then one row per prompt for each decode step."""
    rows = []
    with torch.no_grad():
        per_prompt = [model(torch.tensor([p + tokens[b, :STEPS].tolist()])).logits[0] for b, p in enumerate(prompts)]
    for b, p in enumerate(prompts):
        rows.append(per_prompt[b][:len(p)])
    for s in range(STEPS):
        rows.append(torch.stack([per_prompt[b][len(p) + s] for b, p in enumerate(prompts)]))
    return torch.cat(rows).float()


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", list(CASES))
def test_parallel_matches_one_rank(world, name):
    _, single, _, ranks = world
    ref_logits, ref_tokens, ref_shapes = single[name]
    for r, result in enumerate(ranks):
        logits, tokens, shapes = result[name]
        assert logits.shape == ref_logits.shape, f"rank {r}"
        rel = _rel(logits, ref_logits)
        assert rel < 1e-5, f"{name} rank {r}: logits differ from TP=1 by {rel:.3g} (relative)"
        assert torch.equal(tokens, ref_tokens), f"{name} rank {r}: greedy tokens differ from TP=1"
        # what the rank holds: half the experts whole (EP), or every expert with half its intermediate dim (TP)
        ep = CASES[name][2]
        for (gu, down, start), (full_gu, full_down, _) in zip(shapes, ref_shapes, strict=True):
            if ep:
                assert gu == (full_gu[0] // 2, *full_gu[1:]) and down == (full_down[0] // 2, *full_down[1:])
                assert start == r * full_gu[0] // 2
            else:
                assert gu == (full_gu[0], full_gu[1] // 2, full_gu[2]) and down == (*full_down[:2], full_down[2] // 2)
    assert ref_tokens.shape == (len(world[0][name]), STEPS + 1)
    if CASES[name][0] != "qwen3":
        assert ref_shapes, "the model has sparse blocks"


@pytest.mark.parametrize("name", [n for n, (_, fmt, *_) in CASES.items() if fmt != "dummy"])
def test_parallel_matches_transformers(world, name):
    _, single, theirs, ranks = world
    ref = theirs[name]
    for r, result in enumerate([{name: single[name]}, *ranks]):
        rel = _rel(result[name][0], ref)
        assert rel < 1e-5, f"{name} ({'TP=1' if r == 0 else f'rank {r - 1}'}): logits differ from transformers by {rel:.3g}"


def test_dummy_weights_are_those_of_the_whole_model(world):
    """The dummy TP=1 model holds real random weights (not zeros), and its greedy tokens are not all one id, so
    the TP=2 equality above compares something."""
    _, single, _, _ = world
    for name in ("qwen3-dummy", "qwen2_moe-dummy-ep", "glm4_moe-dummy"):
        logits, tokens, _ = single[name]
        assert logits.abs().max() > 0 and len(set(tokens.flatten().tolist())) > 1, name


def _fake_group(rank: int, size: int) -> TPGroup:
    return TPGroup(rank=rank, size=size, group=object())  # building a shard makes no collective call


def test_shapes_that_do_not_split_are_named():
    from turnout.models.mixtral import MixtralForCausalLM
    from turnout.models.qwen3_moe import Qwen3MoeForCausalLM

    ops = resolve(detect_platform("cpu"))
    with pytest.raises(ValueError, match="enable_expert_parallel: num_experts 6 is not divisible by "
                                         "tensor_parallel_size 4"), torch.device("meta"):
        MixtralForCausalLM(moe_ranks.config("mixtral"), ops, tp=_fake_group(0, 4), expert_parallel=True)
    cfg = moe_ranks.config("qwen3_moe")
    cfg.moe_intermediate_size = 30
    with pytest.raises(ValueError, match="moe intermediate size 30 is not divisible by tensor-parallel size 4"), \
            torch.device("meta"):
        Qwen3MoeForCausalLM(cfg, ops, tp=_fake_group(1, 4))
    with torch.device("meta"):  # the same shape splits by expert id: 8 experts over 4 ranks
        model = Qwen3MoeForCausalLM(cfg, ops, tp=_fake_group(1, 4), expert_parallel=True)
    assert moe_ranks.expert_shapes(model)[0] == ((2, 60, 64), (2, 64, 30), 2)


def test_enable_expert_parallel_must_be_a_bool():
    from turnout.config import EngineConfig

    with pytest.raises(ValueError, match="enable_expert_parallel: must be True or False, got 'yes'"):
        EngineConfig(enable_expert_parallel="yes")


@pytest.mark.parametrize("ep", [False, True])
def test_per_expert_and_stacked_checkpoints_load_the_same_slice(ep):
    """A rank's experts from per-expert tensors and from the stacked layout are the same slice of the full ones;
    under EP another rank's experts are skipped and only this rank's count as missing."""
    from turnout.layers.moe.experts import FusedExperts, expert_weight_rules
    from turnout.loader.weight_map import load_weights

    e, h, i = 4, 8, 6
    gen = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(e, i, h, generator=gen), torch.randn(e, i, h, generator=gen), torch.randn(e, h, i,
                                                                                                          generator=gen)

    class Holder(torch.nn.Module):
        weight_name_rules = expert_weight_rules()

        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Module()
            self.mlp.experts = FusedExperts(e, h, i, ops=None, tp=_fake_group(1, 2), expert_parallel=ep)

    per_expert = [(f"mlp.experts.{x}.{n}.weight", t[x]) for x in range(e)
                  for n, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))]
    a, b = Holder(), Holder()
    load_weights(a, per_expert)
    load_weights(b, [("mlp.experts.gate_up_proj", torch.cat([gate, up], 1)), ("mlp.experts.down_proj", down)])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    gu, dn = a.mlp.experts.gate_up_proj, a.mlp.experts.down_proj
    if ep:  # rank 1 holds experts 2 and 3 whole
        assert torch.equal(gu, torch.cat([gate, up], 1)[2:]) and torch.equal(dn, down[2:])
        mine = [kv for kv in per_expert if kv[0].startswith(("mlp.experts.2.", "mlp.experts.3."))]
        load_weights(Holder(), mine)  # nothing of experts 0 and 1 is needed
        with pytest.raises(ValueError, match=r"missing 1 tensor.*\(3, 'up'\)"):
            load_weights(Holder(), [kv for kv in mine if kv[0] != "mlp.experts.3.up_proj.weight"])
    else:  # rank 1 holds intermediate rows 3..5 of every expert's gate and up, those columns of down
        assert torch.equal(gu, torch.cat([gate[:, 3:], up[:, 3:]], 1)) and torch.equal(dn, down[:, :, 3:])


KW = dict(device="cpu", kv_cache_memory=4 << 20, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)


def test_llm_expert_parallel_matches_one_rank(world, tmp_path):
    """The engine with two ranks splitting the experts by id (the mp executor) against one rank: greedy tokens
    and logprobs through chunked prefill (16-token chunks) and the prefix cache."""
    from turnout import LLM, SamplingParams

    prompts, *_ = world
    model = moe_ranks.build_hf("qwen3_moe")
    model.save_pretrained(tmp_path, safe_serialization=True)
    shared = prompts["qwen3_moe"][1]  # 17 tokens, a prefix of the second prompt
    batch = [shared + [1, 2, 3], shared + [4], prompts["qwen3_moe"][0], [7]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)

    def run(llm):
        outs = llm.generate(batch, params, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                [[_logprob(lp[t]) for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])

    ref_tokens, ref_lps = run(LLM(str(tmp_path), **KW))
    llm = LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True, **KW)
    try:
        tokens, lps = run(llm)
        held = llm.engine.executor.collective_rpc(_held_experts)
    finally:
        llm.engine.executor.shutdown()
    assert held == [[0, 0], [4, 4]]  # two sparse layers (layer 1 is dense), each rank half of 8 experts
    assert tokens == ref_tokens
    for a, b in zip(lps, ref_lps):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def _logprob(entry):
    return entry if isinstance(entry, float) else entry.logprob


def _held_experts(worker):
    return [start for _, _, start in moe_ranks.expert_shapes(worker.loaded.model)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dummy_shard_is_the_slice_of_the_whole(device):
    """A rank's dummy parameters, drawn on the device, are slices of the TP=1 dummy model's: rank 1 of 2 under TP
    (every expert's second half of the intermediate dim, q heads 2-3, embedding rows 48-95, o_proj columns) and
    under EP (experts 4-7 whole). Building a shard makes no collective call, so one process (one GPU) shows it."""
    from transformers import PretrainedConfig

    from turnout.loader import load_model

    cfg = moe_ranks.config("qwen3_moe")
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    ops = resolve(detect_platform(device))
    assert isinstance(cfg, PretrainedConfig)

    def params(tp=None, ep=False):
        loaded = load_model(cfg, load_format="dummy", device=device, dtype="float32", ops=ops, tp=tp,
                            enable_expert_parallel=ep)
        return dict(loaded.model.named_parameters())

    whole, tp, ep = params(), params(_fake_group(1, 2)), params(_fake_group(1, 2), True)
    experts = "model.layers.0.mlp.experts."
    gu, down = whole[experts + "gate_up_proj"], whole[experts + "down_proj"]  # [8, 64, 64], [8, 64, 32]
    assert torch.equal(ep[experts + "gate_up_proj"], gu[4:]) and torch.equal(ep[experts + "down_proj"], down[4:])
    assert torch.equal(tp[experts + "gate_up_proj"], torch.cat([gu[:, 16:32], gu[:, 48:]], 1))
    assert torch.equal(tp[experts + "down_proj"], down[:, :, 16:])
    for shard in (tp, ep):  # attention and the rest split the same way in both
        assert torch.equal(shard["model.embed_tokens.weight"], whole["model.embed_tokens.weight"][48:])
        assert torch.equal(shard["model.layers.0.self_attn.qkv_proj.weight"][:32],
                           whole["model.layers.0.self_attn.qkv_proj.weight"][32:64])  # q heads 2, 3 (head_dim 16)
        assert torch.equal(shard["model.layers.0.self_attn.o_proj.weight"],
                           whole["model.layers.0.self_attn.o_proj.weight"][:, 32:])
        assert torch.equal(shard["model.layers.0.mlp.gate.weight"], whole["model.layers.0.mlp.gate.weight"])
    assert gu.std() > 0.01
