"""Architectures turnout has no class for, run through transformers' modeling code with turnout's paged attention
(turnout/models/transformers_backend): tiny random float32 models on the CPU against HF transformers itself, through
the conformance check `turnout models --check` runs (greedy tokens of the engine for 32 tokens on three prompts,
last-position logits within 1e-4), and the native families through the backend giving the native tokens."""

from __future__ import annotations

import pytest
import torch

from turnout.engine.llm import LLM
from turnout.engine.sampling_params import SamplingParams
from turnout.entrypoints.models_check import LOGITS_TOLERANCE, check_architecture
from turnout.models.registry import MODELS
from turnout.models.transformers_backend.tiny import PROMPTS, save_tiny

# No native class; each supports transformers' attention interface. Variety: learned absolute positions (gpt2,
# gpt_bigcode, opt, ctrl), partial rotary (gptj, codegen, phi, persimmon), parallel blocks (gpt_neox, gptj, cohere,
# phi), LayerNorm (gpt2, gpt_neox, opt, phi, persimmon, cohere), logit scaling (cohere, granite), sliding windows
# (cohere2, starcoder2, granite_swa), (1 + w) norms (gemma), a final soft-cap (nanochat), MoE with per-expert
# checkpoint tensors stacked at load (olmoe, granitemoe, jetmoe), a persistent buffer (apertus). ERNIE-4.5, GPT-OSS
# and Phi-3 ran here until they became native classes.
ARCHITECTURES = [
    "apertus", "arcee", "bitnet", "codegen", "cohere", "cohere2", "ctrl", "diffllama", "exaone4", "gemma",
    "glm", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "granite", "granite_swa", "granitemoe",
    "granitemoeshared", "helium", "hyperclovax", "jetmoe", "nanochat", "olmo", "olmoe", "opt", "persimmon", "phi",
    "starcoder2",
]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_architecture_matches_hf(model_type):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from turnout.models.transformers_backend.support import transformers_class

    cls = transformers_class(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    if not getattr(cls, "_supports_attention_backend", False):  # older transformers (5.17: codegen, gptj)
        pytest.skip(f"{cls.__name__} does not support the attention interface in this transformers")
    res = check_architecture(model_type, "transformers", device="cpu", tokens=32)
    assert res.error is None, res.error
    assert res.architecture not in MODELS  # no native class: transformers' modeling code ran
    assert res.max_logit_diff <= LOGITS_TOLERANCE, f"{res.architecture}: logits differ by {res.max_logit_diff:.2e}"
    assert res.greedy_equal, f"{res.architecture}: greedy tokens differ from transformers'"


def _greedy(llm, prompts, n=32):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "qwen2_moe"])
def test_native_family_through_transformers_gives_the_native_tokens(model_type, tmp_path):
    save_tiny(model_type, tmp_path)
    kw = dict(model=str(tmp_path), dtype="float32", kv_cache_memory=8 << 20)
    native = LLM(**kw, model_impl="auto")
    through = LLM(**kw, model_impl="transformers")
    assert type(native.engine.executor.worker.runner.model).__name__ != "TransformersForCausalLM"
    assert type(through.engine.executor.worker.runner.model).__name__ == "TransformersForCausalLM"
    want, native_outs = _greedy(native, PROMPTS)
    got, through_outs = _greedy(through, PROMPTS)
    assert got == want
    for a, b in zip(native_outs, through_outs):  # the logprobs of the chosen tokens too
        la = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4


def test_prefix_cache_hits_and_chunked_prefill_give_the_same_tokens(tmp_path):
    save_tiny("gpt_neox", tmp_path)
    prefix = list(range(3, 43))  # 40 tokens: two full blocks of 16 shared by every prompt
    prompts = [prefix + [50, 51], prefix + [60], prefix + [70, 71, 72]]
    whole = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=8 << 20, enable_prefix_caching=False)
    want, _ = _greedy(whole, prompts)
    # chunks of 8 tokens and prefix caching: the second pass finds the shared blocks cached
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=8,
              enable_prefix_caching=True)
    first, _ = _greedy(llm, prompts)
    second, outs = _greedy(llm, prompts)
    assert first == want and second == want
    assert all(o.num_cached_tokens >= 32 for o in outs)


def test_weight_update_by_checkpoint_and_transformers_names(tmp_path):
    """RL weight updates name tensors as the checkpoint (or transformers 5) does; they land in place."""
    hf = save_tiny("gpt_neox", tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=8 << 20)
    new = {n: torch.randn_like(p) * 0.1 for n, p in hf.named_parameters() if n.endswith("dense_h_to_4h.weight")}
    llm.update_weights(new)
    with torch.no_grad():
        for n, t in new.items():
            hf.get_parameter(n).copy_(t)
    from turnout.models.transformers_backend.tiny import hf_greedy

    after, _ = _greedy(llm, PROMPTS[:1], 8)
    assert after[0] == hf_greedy(hf, PROMPTS[0], 8)[0]


def test_fp8_quantization_applies_through_the_backend(tmp_path):
    """--quantization fp8 quantises the backend's linear layers (turnout's) as it does the native ones."""
    save_tiny("llama", tmp_path)
    kw = dict(model=str(tmp_path), dtype="float32", kv_cache_memory=4 << 20, quantization="fp8")
    native, _ = _greedy(LLM(**kw), PROMPTS, 8)
    llm = LLM(**kw, model_impl="transformers")
    model = llm.engine.executor.worker.runner.model
    assert any(p.dtype == torch.float8_e4m3fn for n, p in model.named_parameters() if "q_proj" in n)
    got, _ = _greedy(llm, PROMPTS, 8)
    assert got == native
