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


def test_dummy_qwen3_triton_graphs_equal_reference_fp32():
    cfg = os.path.join(CONFIGS, "qwen3-0.6b")
    kw = dict(load_format="dummy", dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3, seed=0)
    fast = LLM(cfg, **kw)  # default policy on CUDA: Triton kernels, CUDA graphs for decode
    assert fast.engine.ops.chosen("paged_attention") == "triton.default"
    got = _greedy(fast, _prompts())
    assert fast.engine.runner.graphs is not None and fast.engine.runner.graphs.stats()["replays"] > 0
    del fast
    torch.cuda.empty_cache()
    ref = LLM(cfg, ops_policy="prefer=reference", enforce_eager=True, **kw)
    assert ref.engine.ops.chosen("paged_attention") == "reference.torch"
    assert _greedy(ref, _prompts()) == got


def test_dummy_qwen3_bf16_graphs_on_equal_off():
    cfg = os.path.join(CONFIGS, "qwen3-0.6b")
    kw = dict(load_format="dummy", dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3, seed=0)
    on = _greedy(LLM(cfg, **kw), _prompts())
    torch.cuda.empty_cache()
    off = _greedy(LLM(cfg, enforce_eager=True, **kw), _prompts())
    assert on == off
    assert all(len(t) == 64 for t in on)


def test_tiny_hf_llama_on_gpu_matches_hf_greedy(tmp_path):
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
            out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
        assert toks == out[0, len(p):].tolist()
