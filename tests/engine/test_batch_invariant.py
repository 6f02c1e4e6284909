"""LLM(batch_invariant=True): one prompt's tokens and logprobs are bit for bit the same alone and inside
batches of 2, 7 and 16 other prompts (at the front, middle, end), with chunked prefill on (a 16-token
budget: the prompt is split and shares steps with the others' chunks and decodes) and off, on a prefix-cache
miss and on a hit (``num_cached_tokens`` checked), for tiny random Qwen3 and Qwen3-MoE in float32 and
bfloat16. The default mode on the same weights is printed for contrast (it is not invariant: a row's
float32 GEMM changes with the number of rows on this CPU), not asserted. Greedy and seeded sampling."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402
from turnout.ops import OpUnavailableError  # noqa: E402

VOCAB = 128
KW = dict(kv_cache_memory=4 << 20, enforce_eager=True, device="cpu", block_size=16)
PARAMS = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=0),
          SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=11, logprobs=0)]


def _config(family):
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if family == "qwen3":
        return transformers.Qwen3Config(**common)
    return transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                       norm_topk_prob=True)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config(request.param), dtype=torch.float32).save_pretrained(
        path, safe_serialization=True)
    return str(path)


def _prompts():
    g = torch.Generator().manual_seed(3)
    target = torch.randint(0, VOCAB, (37,), generator=g).tolist()  # two full blocks: a prefix hit reuses 32
    others = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
              for n in torch.randint(2, 45, (16,), generator=g)]
    return target, others


def _run(llm, prompts, where, params):
    outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
    out = outs[where]
    comp = out.outputs[0]
    lps = torch.tensor([lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)], dtype=torch.float64)
    return comp.token_ids, lps, out.num_cached_tokens


def _ways(target, others):
    """(name, prompts, index of the target): alone, and inside 2, 7 and 16 others at different places."""
    yield "alone", [target], 0
    for n, where in ((2, 1), (7, 0), (16, 16), (16, 5)):
        batch = others[:n]
        yield f"among {n} at {where}", batch[:where] + [target] + batch[where:], where


def _check_invariant(llm_off, llm_on, target, others, label):
    for params in PARAMS:
        llm_off.reset_prefix_cache()
        base_ids, base_lps, cached = _run(llm_off, [target], 0, params)  # alone, no chunking, a cache miss
        assert cached == 0 and len(base_ids) == params.max_tokens
        for llm, chunked in ((llm_off, "chunked off"), (llm_on, "chunked on")):
            for hit in (False, True):
                for name, prompts, where in _ways(target, others):
                    if not hit:
                        llm.reset_prefix_cache()
                    ids, lps, cached = _run(llm, prompts, where, params)
                    assert (cached > 0) == hit, (label, chunked, name, cached)
                    what = f"{label}, {chunked}, prefix {'hit' if hit else 'miss'}, {name}, T={params.temperature}"
                    assert ids == base_ids, f"{what}: tokens {ids} != {base_ids}"
                    assert torch.equal(lps, base_lps), (f"{what}: logprobs differ by "
                                                        f"{(lps - base_lps).abs().max().item():.3g}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tokens_and_logprobs_are_bitwise_batch_invariant(checkpoint, dtype):
    target, others = _prompts()
    llm_off = LLM(model=checkpoint, dtype=dtype, batch_invariant=True, max_num_batched_tokens=4096, **KW)
    llm_on = LLM(model=checkpoint, dtype=dtype, batch_invariant=True, max_num_batched_tokens=16, **KW)
    assert llm_off.engine.ops.policy.batch_invariant and llm_off.engine.runner.model.plan.all_linear
    _check_invariant(llm_off, llm_on, target, others, f"{checkpoint.rsplit('/', 1)[-1]} {dtype}")


def test_default_mode_for_contrast(checkpoint):
    """The same comparison without the mode: printed (where it differs), not asserted."""
    target, others = _prompts()
    for budget in (4096, 16):
        llm = LLM(model=checkpoint, dtype="float32", max_num_batched_tokens=budget, **KW)
        base_ids, base_lps, _ = _run(llm, [target], 0, PARAMS[0])
        worst = {}
        for name, prompts, where in _ways(target, others):
            llm.reset_prefix_cache()
            ids, lps, _ = _run(llm, prompts, where, PARAMS[0])
            worst[name] = (ids == base_ids, (lps - base_lps).abs().max().item())
        print(f"default mode, {checkpoint.rsplit('/', 1)[-1]} float32, max_num_batched_tokens={budget}: "
              f"(same tokens, max |logprob diff|) {worst}")


def test_bad_combinations_name_the_field(checkpoint):
    with pytest.raises(ValueError, match="batch_invariant"):
        LLM(model=checkpoint, batch_invariant=True, tensor_parallel_size=2, **KW)
    # a policy that leaves an op only untagged implementations: a start-up error naming op and platform
    with pytest.raises(OpUnavailableError, match=r"op 'linear' on platform cpu .*not batch-invariant"):
        LLM(model=checkpoint, batch_invariant=True, ops_policy="linear=reference.torch", **KW)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_batch_invariant_on_the_gpu_with_cuda_graphs(checkpoint, dtype):
    """The same checks on a GPU: the Triton batch-invariant kernels, CUDA graphs captured (padded decode
    batches) and async scheduling on, in bfloat16."""
    target, others = _prompts()
    kw = dict(KW, device="cuda", enforce_eager=False)
    llm_off = LLM(model=checkpoint, dtype=dtype, batch_invariant=True, max_num_batched_tokens=4096, **kw)
    llm_on = LLM(model=checkpoint, dtype=dtype, batch_invariant=True, max_num_batched_tokens=16, **kw)
    chosen = {op: llm_off.engine.ops.chosen(op) for op in ("linear", "paged_attention", "moe_experts", "rms_norm")}
    assert all(c == "triton.batch_invariant" for c in chosen.values()), chosen
    assert llm_off.engine.runner.graphs is not None
    _check_invariant(llm_off, llm_on, target, others, f"{checkpoint.rsplit('/', 1)[-1]} {dtype} cuda")
