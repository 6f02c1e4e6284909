"""Tiny random MoE models of each family: turnout's logits against transformers', same checkpoint.

Each model is saved by transformers as safetensors (per-expert tensors, as real checkpoints store
them), loaded with ``turnout.loader.load_model``, and run through the engine's contract
``forward(input_ids, positions, kv_caches, meta)``: a prefill of the prompt, then one decode step that
reads the paged KV cache.
"""

import math

import pytest
import torch

from turnout.layers.attention import AttentionMetadata
from turnout.layers.fusion import FusionPlan, plan_fusions
from turnout.loader import load_model
from turnout.ops import Policy, build_registry, resolve
from turnout.platforms import Platform
from turnout.platforms.detect import detect_platform

PLATFORM = detect_platform("auto")
BLOCK_SIZE = 4
# A GPU platform as the op table sees it, for building a GPU's fusion plan here; its Triton kernels run under the
# interpreter on CPU tensors. Only the ops named in a test's policy take Triton, the rest the reference.
FAKE_GPU = Platform(name="cuda", device_type="cuda", dist_backend="nccl", vendor="cuda", triton_backend=True)


def _gpu_table(*triton_ops):
    return resolve(FAKE_GPU, Policy.parse(";".join(["prefer=reference", *(f"{op}=triton.default" for op in triton_ops)])),
                   build_registry(plugins=False))


def _common(**kw):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=3, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(kw)
    return base


def _configs():
    from transformers import Glm4MoeConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    return {
        # layer 1 dense through mlp_only_layers
        "qwen3_moe": Qwen3MoeConfig(**_common(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
        # layers 0 and 2 dense through decoder_sparse_step=2; a sigmoid-gated shared expert
        "qwen2_moe": Qwen2MoeConfig(**_common(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, norm_topk_prob=False,
                                              decoder_sparse_step=2, num_hidden_layers=4)),
        "mixtral": MixtralConfig(**_common(num_local_experts=6, num_experts_per_tok=2, intermediate_size=48,
                                           num_hidden_layers=2)),
        # sigmoid + correction bias + groups + shared expert + scaling factor + partial rope + qk norm
        "glm4_moe": Glm4MoeConfig(**_common(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                            moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5,
                                            norm_topk_prob=True, first_k_dense_replace=1, partial_rotary_factor=0.5,
                                            use_qk_norm=True, attention_bias=True, head_dim=16)),
    }


def _build_hf(name, dtype):
    from transformers import AutoModelForCausalLM

    config = _configs()[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:  # larger than HF's init so that routing is decisive and every layer matters
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):  # large enough to change the choice
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
    return model.to(dtype)


def _meta(num_new: int, num_cached: int, device):
    total = num_new + num_cached
    nblocks = math.ceil(total / BLOCK_SIZE)
    return AttentionMetadata(
        slot_mapping=torch.arange(num_cached, total, dtype=torch.long, device=device),
        block_tables=torch.arange(nblocks, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([total], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_new], dtype=torch.int32, device=device),
        max_query_len=num_new, max_seq_len=total)


def _run_both(name, tmp_path, device, dtype, policy="", ops=None, plan=None):
    """``ops`` / ``plan``: an op table (default: this machine's under ``policy``) and the fusion plan the model is
    built with (default: none)."""
    hf = _build_hf(name, dtype)
    hf.save_pretrained(tmp_path)
    ops = ops or resolve(PLATFORM, Policy.parse(policy) if policy else Policy())
    loaded = load_model(str(tmp_path), dtype=dtype, device=device, ops=ops, plan=plan)
    model, config = loaded.model, loaded.hf_config
    ids = torch.randint(0, config.vocab_size, (13,), generator=torch.Generator().manual_seed(2))
    prompt, last = ids[:-1].to(device), ids[-1:].to(device)
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (8, BLOCK_SIZE, heads, head_dim)
    kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
          for _ in range(config.num_hidden_layers)]
    with torch.no_grad():
        n = prompt.numel()
        h1 = model(prompt, torch.arange(n, device=device), kv, _meta(n, 0, device))
        h2 = model(last, torch.tensor([n], device=device), kv, _meta(1, n, device))
        ours = torch.cat([model.compute_logits(h1), model.compute_logits(h2)]).float().cpu()
        theirs = hf.to(device)(ids[None].to(device)).logits[0].float().cpu()
    return ours, theirs, model


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"])
def test_logits_match_transformers_fp32(name, tmp_path):
    ours, theirs, model = _run_both(name, tmp_path, "cpu", torch.float32)
    assert any(type(m).__name__ == "SparseMoeBlock" for m in model.modules())
    scale = theirs.abs().max()
    err = (ours - theirs).abs().max()
    assert err <= 1e-4 * scale, f"{name}: max |diff| {err:.3g} vs max |logit| {scale:.3g}"


def test_glm4_moe_through_triton_experts(tmp_path):
    """The same model with the Triton expert backend (interpreter on CPU) gives the same logits."""
    ours, theirs, _ = _run_both("glm4_moe", tmp_path, "cpu", torch.float32, policy="moe_experts=triton.default")
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
def test_decode_with_norms_fused_into_projections(name, tmp_path, monkeypatch):
    """The one-token step with each pre-norm computed inside the projection that reads it
    (add_rms_norm_linear, Triton under the interpreter on CPU): dense and MoE layers, Qwen2-MoE's gated
    shared expert, GLM's float32 router. Same logits as transformers, and every layer's two norms fused."""
    if not PLATFORM.triton_usable():
        pytest.skip("Triton does not run here")
    from turnout.ops.triton import linear

    calls = []
    fused = linear.add_rms_norm_linear
    monkeypatch.setattr(linear, "add_rms_norm_linear", lambda *a: calls.append(a[0].shape) or fused(*a))
    ops = _gpu_table("small_m_linear", "add_rms_norm_linear")  # the table a GPU resolves for these two ops
    plan = plan_fusions(ops)
    assert plan.one_row_linear and plan.prenorm_linear and not plan.rope_attention
    ours, theirs, model = _run_both(name, tmp_path, "cpu", torch.float32, ops=ops, plan=plan)
    # GLM's float32 router takes the normed row as a tensor (its projection runs in fp32): not fused there
    fp32_routers = sum(bool(getattr(getattr(layer.mlp, "gate", None), "logits_fp32", False))
                       for layer in model.model.layers)
    assert fp32_routers == (2 if name == "glm4_moe" else 0)
    assert len(calls) == 2 * model.config.num_hidden_layers - fp32_routers and all(c[0] == 1 for c in calls)
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_decode_with_rope_inside_attention(name, tmp_path, monkeypatch):
    """The one-token step with q/k norm (Qwen3, GLM), RoPE (GLM: partial) and the cache write inside the
    attention kernel (rotary_paged_attention, Triton under the interpreter): same logits as transformers,
    one call per layer, and the prefill does not take it."""
    if not PLATFORM.triton_usable():
        pytest.skip("Triton does not run here")
    from turnout.ops.triton import attention

    calls = []
    fused = attention.rotary_paged_attention
    monkeypatch.setattr(attention, "rotary_paged_attention", lambda *a: calls.append(a[15]) or fused(*a))
    ops = _gpu_table("rotary_paged_attention")
    plan = plan_fusions(ops, rope_attention=True)
    assert plan == FusionPlan(rope_attention=True)
    ours, theirs, model = _run_both(name, tmp_path, "cpu", torch.float32, ops=ops, plan=plan)
    assert calls == [1] * model.config.num_hidden_layers  # max_query_len of the decode step only
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def test_norm_fusion_only_where_the_predicate_allows(tmp_path, monkeypatch):
    """``FusionPlan.prenorm_pays``: a projection whose (N, K) the predicate refuses (here the routers,
    N = 8 experts) gets the plain norm; the others stay fused; the logits do not change."""
    if not PLATFORM.triton_usable():
        pytest.skip("Triton does not run here")
    from turnout.ops.triton import linear

    shapes = []
    fused = linear.add_rms_norm_linear
    monkeypatch.setattr(linear, "add_rms_norm_linear", lambda *a: shapes.append(tuple(a[4].shape)) or fused(*a))
    plan = FusionPlan(one_row_linear=True, prenorm_linear=True, prenorm_pays=lambda n, k: n != 8)
    ours, theirs, model = _run_both("qwen3_moe", tmp_path, "cpu", torch.float32,
                                    ops=_gpu_table("small_m_linear", "add_rms_norm_linear"), plan=plan)
    assert shapes and all(n != 8 for n, _ in shapes)
    assert len(shapes) == model.config.num_hidden_layers + 1  # every qkv, and the dense layer's gate_up
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def test_dense_layers_where_the_config_says():
    from turnout.layers.moe.layer import is_moe_layer

    cfgs = _configs()
    assert [is_moe_layer(cfgs["qwen3_moe"], i) for i in range(3)] == [True, False, True]
    assert [is_moe_layer(cfgs["qwen2_moe"], i) for i in range(4)] == [False, True, False, True]
    assert [is_moe_layer(cfgs["glm4_moe"], i) for i in range(3)] == [False, True, True]
    assert [is_moe_layer(cfgs["mixtral"], i) for i in range(2)] == [True, True]


def _rel_err(logits, truth):
    """Relative L2 distance of logits from the float32 reference logits."""
    truth = truth.float()
    return ((logits.float() - truth).norm() / truth.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"])
def test_logits_match_transformers_bf16_gpu(name, tmp_path):
    """bf16 "within bf16 tolerance": near-tied routing scores may pick other experts in bf16 (sigmoid +
    groups in GLM especially), so both bf16 runs are measured against HF in float32 on the GPU, and ours
    must be about as close to it as HF's own bf16 run (or within 3e-2)."""
    ours, theirs, _ = _run_both(name, tmp_path / "bf16", "cuda", torch.bfloat16)
    _, truth, _ = _run_both(name, tmp_path / "fp32", "cuda", torch.float32)
    rel_ours, rel_hf = _rel_err(ours, truth), _rel_err(theirs, truth)
    assert rel_ours <= max(3e-2, 1.5 * rel_hf), f"{name}: ours {rel_ours:.3g} vs HF bf16 {rel_hf:.3g} (from fp32)"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_decode_fused_kernels_bf16_gpu(name, tmp_path):
    """On the GPU in bf16, the batch-1 decode wiring with every fusion on (one-row projections, norms in the
    projections, q/k norm + RoPE + cache write inside attention) gives the same logits as the same model
    without them, within bf16 tolerance of HF's float32 logits."""
    ops = resolve(PLATFORM, Policy())
    plan = plan_fusions(ops, rope_attention=True)
    assert plan.one_row_linear and plan.prenorm_linear and plan.rope_attention  # what a GPU's engine builds
    # every projection fused here (the tiny shapes all pass norm_fusion_pays)
    fused, _, _ = _run_both(name, tmp_path / "fused", "cuda", torch.bfloat16, ops=ops, plan=plan)
    plain, _, _ = _run_both(name, tmp_path / "plain", "cuda", torch.bfloat16)
    _, truth, _ = _run_both(name, tmp_path / "fp32", "cuda", torch.float32)
    rel_fused, rel_plain = _rel_err(fused, truth), _rel_err(plain, truth)
    assert rel_fused <= max(3e-2, 1.5 * rel_plain), f"{name}: fused {rel_fused:.3g} vs plain {rel_plain:.3g}"


@pytest.mark.parametrize("name", ["glm4_moe", "qwen3_moe"])
def test_engine_greedy_matches_transformers_generate(name, tmp_path):
    """Batched greedy decoding through the engine (scheduler, paged KV, sampler) equals HF generate."""
    from turnout import LLM, SamplingParams

    hf = _build_hf(name, torch.float32)
    hf.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", kv_cache_memory=1 << 22)
    prompts = [[1, 5, 7, 9, 11], [3, 4, 5]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt):].tolist()
