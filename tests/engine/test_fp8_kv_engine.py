"""LLM(kv_cache_dtype="fp8") on a tiny float32 Qwen3 against the same model with its cache in float32: the
cache holds 4x the blocks in the same memory (1 byte per element instead of 4), greedy tokens equal where the
float32 run's margin is clear and logprobs within fp8 tolerance; prefix-cache hits and swap preemption work
with an fp8 cache (tokens equal an ample fp8 cache's); a checkpoint's k_scale / v_scale load (and are ignored
with auto); a bad value is a ValueError naming kv_cache_dtype."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402
from turnout.config import EngineConfig  # noqa: E402

VOCAB = 256
# e4m3 keeps 3 mantissa bits (up to 6 % off per cached element): on this model (logprobs of the greedy tokens
# around -2, vocabulary 256) the float32-cache and fp8-cache logprobs differed by at most 0.22 over 40 steps
LOGPROB_TOL = 0.3
KW = dict(kv_cache_memory=2 << 20, enforce_eager=True, device="cpu", block_size=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_fp8kv")
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, num_hidden_layers=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engines(checkpoint):
    return LLM(checkpoint, **KW), LLM(checkpoint, kv_cache_dtype="fp8", **KW)


def _prompts(n, lo=8, hi=60, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def test_blocks_and_dtype(engines):
    auto, fp8 = engines
    ra, rf = auto.engine.runner, fp8.engine.runner
    assert ra.kv_caches[0][0].dtype == torch.float32 and rf.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert rf.block_bytes * 4 == ra.block_bytes
    assert rf.num_blocks == KW["kv_cache_memory"] // rf.block_bytes == 4 * ra.num_blocks
    assert auto.engine.ops.policy.kv_cache == "auto" and fp8.engine.ops.policy.kv_cache == "fp8"
    attn = rf.model.model.layers[0].self_attn.attn
    assert attn.k_scale.dtype == torch.float32 and float(attn.k_scale) == 1.0


def test_greedy_and_logprobs_within_fp8_tolerance(engines):
    auto, fp8 = engines
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    prompts = _prompts(6)
    compared = 0
    for a, f in zip(auto.generate(prompts, params, use_tqdm=False), fp8.generate(prompts, params, use_tqdm=False)):
        ca, cf = a.outputs[0], f.outputs[0]
        for step, (ta, tf) in enumerate(zip(ca.token_ids, cf.token_ids)):
            top = sorted((lp.logprob for lp in ca.logprobs[step].values()), reverse=True)
            margin = top[0] - top[1]
            if ta != tf:
                assert margin < 0.2, f"step {step}: tokens {ta} != {tf} with a clear margin {margin:.3f}"
                break  # the sequences differ from here on
            diff = abs(ca.logprobs[step][ta].logprob - cf.logprobs[step][tf].logprob)
            assert diff < LOGPROB_TOL, f"step {step}: logprob differs by {diff:.3f}"
            compared += 1
    assert compared >= 30, compared


def test_prefix_cache_hit_with_fp8(engines):
    _, fp8 = engines
    prompt = _prompts(1, 40, 41, seed=7)[0]  # two full blocks and a bit
    params = SamplingParams(max_tokens=8, temperature=0.0)
    fp8.reset_prefix_cache()
    first = fp8.generate([prompt], params, use_tqdm=False)[0]
    again = fp8.generate([prompt], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_swap_preemption_with_fp8(checkpoint, engines):
    _, ample = engines
    prompts = _prompts(8, 30, 50, seed=11)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    want = [o.outputs[0].token_ids for o in ample.generate(prompts, params, use_tqdm=False)]
    # 24 blocks of 16 tokens: 8 sequences growing to ~90 tokens cannot all stay
    small = LLM(checkpoint, kv_cache_dtype="fp8", preemption_mode="swap", swap_space=0.05, max_num_seqs=8,
                **{**KW, "kv_cache_memory": 24 * ample.engine.runner.block_bytes})
    assert small.engine.runner.kv_transfer.host_caches[0][0].dtype == torch.float8_e4m3fn
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.get_stats().swap_preemptions_total > 0
    assert got == want


def test_checkpoint_scales(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "scaled"
    shutil.copytree(checkpoint, path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([0.25])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    fp8 = LLM(str(path), kv_cache_dtype="fp8", **KW)
    layers = fp8.engine.runner.model.model.layers
    assert float(layers[0].self_attn.attn.k_scale) == 0.5 and float(layers[0].self_attn.attn.v_scale) == 1.0
    assert float(layers[1].self_attn.attn.v_scale) == 0.25
    # the scales are applied both ways (stored x / s, read back times s): the same model as the float32 cache
    auto = LLM(str(path), **KW)  # auto: the scales are dropped, the load succeeds
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    for prompt in _prompts(4, seed=5):
        a, f = (e.generate([prompt], params, use_tqdm=False)[0].outputs[0] for e in (auto, fp8))
        if a.token_ids == f.token_ids:
            t = a.token_ids[0]
            assert abs(a.logprobs[0][t].logprob - f.logprobs[0][t].logprob) < LOGPROB_TOL


def test_bad_value_names_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)


def test_default_max_num_seqs():
    from turnout.worker.concurrency import default_max_num_seqs

    # the run: 512 sequences of 1536 tokens held -> 512; fewer held -> at least 256; many -> 1024
    assert default_max_num_seqs(512 * 96, 16, 1536) == 512
    assert default_max_num_seqs(100, 16, 1536) == 256
    assert default_max_num_seqs(10 ** 7, 16, 1536) == 1024
    assert default_max_num_seqs(500 * 96 + 95, 16, 1536) == 496  # rounded down to 16


def _worst_gaps(a_outs, b_outs):
    """(|logprob difference|, prompt, step) of each greedy step where the two runs still agree on the tokens."""
    worst = []
    for i, (a, b) in enumerate(zip(a_outs, b_outs)):
        ca, cb = a.outputs[0], b.outputs[0]
        for step, (ta, tb) in enumerate(zip(ca.token_ids, cb.token_ids)):
            if ta != tb:
                break
            worst.append((abs(ca.logprobs[step][ta].logprob - cb.logprobs[step][tb].logprob), i, step))
    return sorted(worst, reverse=True)


@pytest.mark.gpu
def test_fp8_kv_on_gpu(checkpoint):
    """On a GPU: the Triton kernels serve the fp8 cache (compiled), CUDA graphs on, bf16; blocks double. The fp8
    cache moves the greedy logprobs away from the bf16 cache's by quantisation noise, whose size depends on the
    model: the peer is the same fp8 cache computed by the PyTorch reference ops on the same GPU, and the Triton
    path may differ from bf16 by no more than the reference does (plus bf16's own rounding between kernels)."""
    kw = dict(kv_cache_memory=64 << 20, dtype="bfloat16", block_size=16)
    auto, fp8 = LLM(checkpoint, **kw), LLM(checkpoint, kv_cache_dtype="fp8", **kw)
    blocks = (auto.engine.runner.num_blocks, fp8.engine.runner.num_blocks)
    assert blocks[1] == 2 * blocks[0], blocks
    for op in ("reshape_and_cache", "qk_norm_rotary_cache", "paged_attention", "rotary_paged_attention"):
        assert fp8.engine.ops.chosen(op).startswith("triton"), (op, fp8.engine.ops.chosen(op))
    assert fp8.engine.runner.graphs is not None
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    prompts = _prompts(6)
    outs = {name: llm.generate(prompts, params, use_tqdm=False) for name, llm in (("auto", auto), ("fp8", fp8))}
    del auto, fp8
    ref = LLM(checkpoint, kv_cache_dtype="fp8", ops_policy="prefer=reference", enforce_eager=True, **kw)
    assert ref.engine.ops.chosen("paged_attention").startswith("reference")
    outs["ref"] = ref.generate(prompts, params, use_tqdm=False)
    triton_gap, ref_gap = _worst_gaps(outs["auto"], outs["fp8"]), _worst_gaps(outs["auto"], outs["ref"])
    # step 0 comes from the prefill kernels, later steps from the decode ones: the message says which, and how far
    # the two fp8 paths are from each other
    assert triton_gap[0][0] <= 1.25 * ref_gap[0][0] + 0.05, (triton_gap[:5], ref_gap[:5],
                                                             _worst_gaps(outs["ref"], outs["fp8"])[:5])
