"""SamplingParams(return_routed_experts=True) against HF transformers' router: for every MoE layer and every
token the model read (prompt and generated, float32 tiny random Qwen3-MoE with a dense layer, and Qwen2-MoE
with a shared expert and a sparse step), the expert ids equal the top-k of HF's gate logits, captured by a
forward hook on each layer's public ``mlp.gate`` module while HF re-reads the whole sequence. Chunked
prefill and async scheduling on, a prefix-cache hit bypassed, n > 1, prompt_logprobs alongside."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402

PROMPTS = [[3, 17, 42, 8, 91, 5, 60], list(range(20, 58))]
KW = dict(kv_cache_memory=2 << 20, enforce_eager=True, dtype="float32", device="cpu")


def _common(**kw):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=3, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(kw)
    return base


def _config(name):
    if name == "qwen3_moe":  # layer 1 dense (mlp_only_layers): two MoE layers
        return transformers.Qwen3MoeConfig(**_common(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, norm_topk_prob=True,
                                                     mlp_only_layers=[1]))
    # layers 0 and 2 dense (decoder_sparse_step=2), a sigmoid-gated shared expert
    return transformers.Qwen2MoeConfig(**_common(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48, norm_topk_prob=False,
                                                 decoder_sparse_step=2, num_hidden_layers=4))


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_config(request.param), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # decisive routing: every layer matters
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
    hf.save_pretrained(path, safe_serialization=True)
    return hf.eval(), str(path)


@torch.no_grad()
def _hf_routing(hf, ids, k):
    """[len(ids), moe layers, k] sorted expert ids: the top-k of each MoE layer's gate logits."""
    got = []

    def hook(_module, _inputs, out):
        logits = out[0] if isinstance(out, tuple) else out  # a router returning (logits, weights, ids), or a Linear
        got.append(logits.reshape(len(ids), -1).topk(k, dim=-1).indices)

    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(got, dim=1).sort(dim=-1).values


def _check(hf, prompt, comp, k):
    read = list(prompt) + comp.token_ids[:-1]  # the last generated token is never read
    ours = torch.from_numpy(comp.routed_experts)
    assert ours.dtype == torch.int32
    want = _hf_routing(hf, read, k)
    assert ours.shape == want.shape, (ours.shape, want.shape)
    assert torch.equal(ours.long().sort(dim=-1).values, want), "routing differs from HF's gate top-k"


def test_routed_experts_equal_hf(checkpoint):
    hf, path = checkpoint
    k = hf.config.num_experts_per_tok
    llm = LLM(path, max_num_batched_tokens=6, async_scheduling=True, **KW)  # chunked prefill, lookahead on
    assert llm.engine.runner.routing.num_layers == len([m for m in hf.model.layers if hasattr(m.mlp, "gate")])
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    outs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        _check(hf, prompt, out.outputs[0], k)
    # a prefix-cache hit is bypassed: the second run of the long prompt still routes every position
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([PROMPTS[1]], plain, use_tqdm=False)
    assert llm.generate([PROMPTS[1]], plain, use_tqdm=False)[0].num_cached_tokens > 0
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    _check(hf, PROMPTS[1], out.outputs[0], k)
    # n > 1, sampled: each sample its own generated rows after the shared prompt; not asked: None
    outs = llm.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=3,
                                                     return_routed_experts=True, prompt_logprobs=1), use_tqdm=False)
    for comp in outs[0].outputs:
        _check(hf, PROMPTS[0], comp, k)
    assert outs[0].prompt_logprobs is not None
    assert llm.generate([PROMPTS[0]], plain, use_tqdm=False)[0].outputs[0].routed_experts is None
    tok = llm.generate_tokens(PROMPTS[0], params)
    assert tok.routed_experts.shape == (len(PROMPTS[0]) + 4, llm.engine.runner.routing.num_layers, k)


def test_dense_model_refuses_routed_experts(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **KW)
    with pytest.raises(ValueError, match="return_routed_experts"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, return_routed_experts=True), use_tqdm=False)
    with pytest.raises(ValueError, match="return_routed_experts"):
        SamplingParams(return_routed_experts=1)
