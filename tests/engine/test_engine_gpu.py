"""The engine on a GPU: Triton kernels + CUDA graphs against the reference implementations and HF."""

import os

import pytest
import torch

from turnout import LLM, SamplingParams

pytestmark = pytest.mark.gpu

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")


def _prompts(n=4, vocab=151936):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in (5, 33, 100, 257)[:n]]


def _greedy(llm, prompts, n=64):
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, p)]


@pytest.fixture(scope="module")
def reference_fp32_tokens():
    cfg = os.path.join(CONFIGS, "qwen3-0.6b")
    ref = LLM(cfg, ops_policy="prefer=reference", enforce_eager=True, **_KW_FP32)
    assert ref.engine.ops.chosen("paged_attention") == "reference.torch"
    toks = _greedy(ref, _prompts())
    del ref
    torch.cuda.empty_cache()
    return toks


_KW_FP32 = dict(load_format="dummy", dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3, seed=0)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_dummy_qwen3_triton_equals_reference_fp32(enforce_eager, reference_fp32_tokens):
    # float32: random dummy weights give near-flat distributions, where bf16 rounding alone flips argmaxes
    cfg = os.path.join(CONFIGS, "qwen3-0.6b")
    fast = LLM(cfg, enforce_eager=enforce_eager, **_KW_FP32)  # default policy on CUDA: Triton kernels
    assert fast.engine.ops.chosen("paged_attention") == "triton.default"
    got = _greedy(fast, _prompts())
    graphs = fast.engine.runner.graphs
    if enforce_eager:
        assert graphs is None
    else:
        assert graphs is not None and graphs.stats()["replays"] > 0, graphs and graphs.stats()
    assert got == reference_fp32_tokens


def test_dummy_qwen3_bf16_with_graphs_runs():
    cfg = os.path.join(CONFIGS, "qwen3-0.6b")
    llm = LLM(cfg, load_format="dummy", dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3, seed=0)
    toks = _greedy(llm, _prompts())
    assert all(len(t) == 64 for t in toks)
    assert llm.engine.runner.graphs.stats()["replays"] >= 60


def test_tiny_hf_llama_on_gpu_matches_hf_greedy(tmp_path):
    """Our greedy tokens are HF's argmax at every step, up to float ties (random tiny weights give
    near-flat logits, so equal-up-to-1e-5 maxima are accepted as ties)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    hf = hf.cuda()
    prompts = _prompts(3, 512)
    llm = LLM(str(tmp_path), dtype="float32", gpu_memory_utilization=0.2)
    got = _greedy(llm, prompts, 32)
    for p, toks in zip(prompts, got):
        with torch.no_grad():
            logits = hf(torch.tensor([p + toks], device="cuda")).logits[0, len(p) - 1: -1].float()
        chosen = logits.gather(1, torch.tensor(toks, device="cuda")[:, None])[:, 0]
        gap = (logits.max(-1).values - chosen).abs()
        assert gap.max().item() <= 1e-5 * logits.abs().max().item(), gap


def test_graph_batches_shrinking_and_growing_match_eager_fp32():
    """Sequences of different lengths leave the graph batch one by one (4 -> 1 lanes: the rows they leave are
    re-padded), and a second round grows it again: the same greedy tokens as eager mode."""
    cfg = os.path.join(CONFIGS, "qwen3-0.6b")
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 20, 41, 64)]
    outs = {}
    for eager in (True, False):
        llm = LLM(cfg, enforce_eager=eager, **_KW_FP32)
        outs[eager] = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for _ in range(2)]
        if not eager:
            assert llm.engine.runner.graphs.stats()["replays"] > 100
        del llm
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]
    assert [len(t) for t in outs[False][0]] == [8, 20, 41, 64]
