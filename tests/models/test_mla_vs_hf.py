"""The latent-attention families against transformers on tiny random float32 checkpoints (CPU):

- DeepSeek-V2-Lite-shaped: no query compression, softmax greedy routing, two shared experts, a dense first layer;
- DeepSeek-V3-shaped: q_lora, noaux_tc routing over 4 groups (keep 2) with a non-zero correction bias,
  routed_scaling_factor 2.5, YaRN rope with mscale / mscale_all_dim (the softmax scale changes), interleaved rope;
- GLM-4-MoE-Lite-shaped: mlp_layer_types, rotate-half rope (rope_interleave False), noaux_tc without groups.

For each: last-position logits of three prompts within 1e-4 (of the largest logit) of transformers', and 32 greedy
tokens through the engine identical to transformers' ``generate``. Then through the engine: prefix-cache hits,
chunked prefill, swap preemption and an fp8 latent cache; and the refusals (a missing or misshapen latent
projection names the tensor, DeepSeek-V3.2's indexer names the field).
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402
from turnout.kv.spec import CacheLayout, LatentSpec  # noqa: E402
from turnout.layers.attention import AttentionMetadata  # noqa: E402
from turnout.loader import load_model  # noqa: E402
from turnout.ops import resolve  # noqa: E402
from turnout.platforms.detect import detect_platform  # noqa: E402
from turnout.worker.kv_sizing import allocate_caches  # noqa: E402

VOCAB, BLOCK, STEPS = 128, 16, 32
KW = dict(kv_cache_memory=4 << 20, enforce_eager=True, device="cpu", block_size=BLOCK)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False)


def tiny_config(kind: str):
    if kind == "v2_lite":
        return transformers.DeepseekV2Config(**COMMON, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
                                             n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
                                             routed_scaling_factor=1.0)
    if kind == "v3":
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
        return transformers.DeepseekV3Config(**COMMON, q_lora_rank=24, n_routed_experts=16, num_experts_per_tok=4,
                                             n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                                             routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=yarn,
                                             rope_interleave=True, num_nextn_predict_layers=0)
    if kind == "glm4_moe_lite":
        return transformers.Glm4MoeLiteConfig(**COMMON, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                                              n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.8,
                                              mlp_layer_types=["dense", "sparse", "sparse"], rope_interleave=False)
    raise AssertionError(kind)


KINDS = ("v2_lite", "v3", "glm4_moe_lite")


def build_hf(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:  # larger than HF's init so that routing is decisive and every layer matters
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change the choice
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        hf = build_hf(kind)
        hf.save_pretrained(path)
        out[kind] = (str(path), hf)
    return out


def prompts(n=3, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(5, 40, (n,), generator=g)]


def decisive_prompts(hf, n=3, seed=5, limit=0.02):
    """Prompts whose bfloat16 logits do not hang on a near-tie of the router. Grouped routing in the V3 shape has
    prompts where one bf16 rounding step flips an expert and moves the last logits by 15-70 %; any two bf16
    implementations (ours on the GPU, transformers) can land on either side there. A prompt is kept when the peer
    in bf16 is within ``limit`` (of the largest logit) of the peer in float32, and stays within it when its input
    embeddings are scaled by 1 + 2^-8. The prompts come from ``prompts`` with successive seeds, in order."""
    import copy

    peer = copy.deepcopy(hf).to(torch.bfloat16)
    out, s = [], seed
    while len(out) < n:
        for ids in prompts(n, seed=s):
            with torch.no_grad():
                exact = hf(torch.tensor([ids])).logits[0, -1]
                emb = peer.get_input_embeddings()(torch.tensor([ids]))
                base = peer(inputs_embeds=emb).logits[0, -1].float()
                nudged = peer(inputs_embeds=emb * (1 + 2 ** -8)).logits[0, -1].float()
            scale = limit * exact.abs().max()
            if (base - exact).abs().max() <= scale and (nudged - base).abs().max() <= scale and len(out) < n:
                out.append(ids)
        s += 1
        assert s < seed + 50, "no decisive prompts in 50 seeds"
    return out


def _prefill(model, ids: list[int]):
    """Our logits at every position of one prompt: a prefill over a fresh latent cache."""
    n = len(ids)
    layout = CacheLayout(tuple(model.kv_specs("float32")))
    nb = -(-n // BLOCK)
    caches = allocate_caches(layout, nb, BLOCK, 1, "cpu")
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange(nb, dtype=torch.int32)[None],
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n, max_seq_len=n)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


@pytest.mark.parametrize("kind", KINDS)
def test_last_logits_within_1e_4_of_transformers(kind, checkpoints):
    path, hf = checkpoints[kind]
    model = load_model(path, dtype=torch.float32, device="cpu", ops=resolve(detect_platform("cpu"))).model
    assert all(isinstance(s, LatentSpec) for s in model.kv_specs("float32"))
    for ids in prompts():
        ours = _prefill(model, ids)[-1]
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0, -1]
        err = (ours - theirs).abs().max().item()
        assert err <= 1e-4 * theirs.abs().max().item(), f"{kind}: max |diff| {err:.3g}"


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_32_tokens_equal_transformers(kind, checkpoints):
    path, hf = checkpoints[kind]
    llm = LLM(path, **KW)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
    for ids, ours in zip(prompts(), got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS,
                              pad_token_id=0, eos_token_id=None)
        assert list(ours) == out[0, len(ids):].tolist(), kind


@pytest.fixture(scope="module")
def v3_reference(checkpoints):
    """Greedy tokens of the V3-shaped model with an ample cache, whole prefills, no prefix cache."""
    path, _ = checkpoints["v3"]
    llm = LLM(path, enable_prefix_caching=False, **KW)
    ps = prompts(6, seed=11)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = llm.generate(ps, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    block_bytes = llm.engine.runner.block_bytes
    return ps, params, [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], block_bytes


def test_prefix_hits_and_chunked_prefill_give_the_same_tokens(checkpoints, v3_reference):
    path, _ = checkpoints["v3"]
    ps, params, want, _, block_bytes = v3_reference
    llm = LLM(path, max_num_batched_tokens=16, **KW)  # prompts up to 40 tokens: prefilled in chunks of 16
    shared = ps[0][:5] * 7  # 35 tokens: two full blocks to hit
    first = llm.generate([shared], params, use_tqdm=False)[0]
    again = llm.generate([shared], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)] == want


def test_swap_preemption_gives_the_same_tokens(checkpoints, v3_reference):
    path, _ = checkpoints["v3"]
    ps, params, want, _, block_bytes = v3_reference
    small = LLM(path, preemption_mode="swap", swap_space=0.05, max_num_seqs=8,
                **{**KW, "kv_cache_memory": 12 * block_bytes})  # 6 sequences growing to ~56 tokens: not all fit
    got = [o.outputs[0].token_ids for o in small.generate(ps, params, use_tqdm=False)]
    assert small.get_stats().swap_preemptions_total > 0
    assert got == want


def test_fp8_latent_cache(checkpoints, v3_reference):
    path, _ = checkpoints["v3"]
    ps, params, want, logprobs, _ = v3_reference
    llm = LLM(path, kv_cache_dtype="fp8", **KW)
    runner = llm.engine.runner
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn and len(runner.kv_caches[0]) == 1
    assert runner.kv_caches[0][0].shape[-1] == 32 + 8  # kv_lora_rank + qk_rope_head_dim, one vector per token
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    # e4m3 keeps 3 mantissa bits: on these models a logprob moves by up to 0.2 with an fp8 cache (measured, as
    # on the fp8 Qwen3 test), so two tokens may swap where the float32 run's best two are within twice that. Equal
    # tokens wherever its choice is clear; the first step where they differ must be one where they were close
    compared = 0
    for g, w, lps in zip(got, want, logprobs):
        for step, (a, b) in enumerate(zip(g, w)):
            if a != b:
                top = sorted((lp.logprob for lp in lps[step].values()), reverse=True)
                assert top[0] - top[1] < 0.5, f"step {step}: {a} != {b} with a clear margin {top[0] - top[1]:.3f}"
                break
            compared += 1
    assert compared >= 20, compared


def _edit_checkpoint(src: str, dst, edit) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_missing_or_misshapen_latent_projection_is_refused_by_name(checkpoints, tmp_path):
    path, _ = checkpoints["v3"]
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    missing = _edit_checkpoint(path, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.kv_b_proj\.weight"):
        load_model(missing, dtype=torch.float32, device="cpu", ops=resolve(detect_platform("cpu")))
    name = "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"
    bad = _edit_checkpoint(path, tmp_path / "bad", lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa\.weight"):
        load_model(bad, dtype=torch.float32, device="cpu", ops=resolve(detect_platform("cpu")))


def test_sparse_indexer_variant_is_refused_by_field(checkpoints, tmp_path):
    import json

    path, _ = checkpoints["v3"]
    dst = tmp_path / "v32"
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["index_topk"] = 2048
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="index_topk"):
        load_model(str(dst), dtype=torch.float32, device="cpu", ops=resolve(detect_platform("cpu")))


def test_through_the_triton_kernels_prefill_and_decode(checkpoints):
    """The V3-shaped model with both MLA ops on their Triton kernels (the interpreter here): a prefill, then
    decode steps over the paged latent cache (split-KV), each step's logits within 1e-4 of transformers'."""
    from turnout.ops import Policy

    path, hf = checkpoints["v3"]
    policy = Policy.parse("mla_paged_attention=triton.default;mla_reshape_and_cache=triton.default")
    ops = resolve(detect_platform("cpu"), policy)
    assert ops.resolutions["mla_paged_attention"].chosen == "triton.default"
    model = load_model(path, dtype=torch.float32, device="cpu", ops=ops).model
    ids = prompts(1, seed=9)[0][:20]
    n, steps = len(ids), 4
    layout = CacheLayout(tuple(model.kv_specs("float32")))
    nb = -(-(n + steps) // BLOCK) + 2
    caches = allocate_caches(layout, nb, BLOCK, 1, "cpu")
    table = torch.randperm(nb, generator=torch.Generator().manual_seed(0))[None].to(torch.int32)  # scattered

    def meta(start, count):
        pos = torch.arange(start, start + count)
        slots = table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK
        return pos, AttentionMetadata(slot_mapping=slots, block_tables=table,
                                      seq_lens=torch.tensor([start + count], dtype=torch.int32),
                                      query_start_loc=torch.tensor([0, count], dtype=torch.int32),
                                      max_query_len=count, max_seq_len=start + count)

    tokens = list(ids)
    with torch.inference_mode():
        pos, m = meta(0, n)
        ours = [model.compute_logits(model(torch.tensor(ids), pos, caches, m))[-1]]
        for _ in range(steps):
            tokens.append(int(ours[-1].argmax()))
            pos, m = meta(len(tokens) - 1, 1)
            ours.append(model.compute_logits(model(torch.tensor(tokens[-1:]), pos, caches, m))[0])
        theirs = hf(torch.tensor([tokens])).logits[0, n - 1:]
    for step, (a, b) in enumerate(zip(ours, theirs)):
        err = (a - b).abs().max().item()
        assert err <= 1e-4 * b.abs().max().item(), f"step {step}: max |diff| {err:.3g}"


def test_mtp_layers_are_loaded_and_kept(checkpoints, tmp_path):
    """A checkpoint with one multi-token-prediction layer (``model.layers.3``, as DeepSeek-V3 ships layer 61): its
    decoder layer, projections, own embedding and head load into ``model.mtp``, the causal LM is unchanged, and
    the layer runs. Without one of its tensors the load is refused naming it."""
    import json

    from safetensors.torch import load_file

    path, _ = checkpoints["v3"]
    donor = build_hf_layers("v3", 4)  # a fourth decoder layer of the same shape, for layer 3's block
    extra = {k: v for k, v in donor.state_dict().items() if k.startswith("model.layers.3.")}
    g = torch.Generator().manual_seed(8)
    h = 64
    extra.update({"model.layers.3.enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                  "model.layers.3.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                  "model.layers.3.eh_proj.weight": torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5,
                  "model.layers.3.embed_tokens.weight": torch.randn(VOCAB, h, generator=g),
                  "model.layers.3.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                  "model.layers.3.shared_head.head.weight": torch.randn(VOCAB, h, generator=g) * h ** -0.5})

    def with_mtp(dst, drop=None):
        out = _edit_checkpoint(path, dst, lambda t: t.update({k: v for k, v in extra.items() if k != drop}))
        cfg = json.loads((dst / "config.json").read_text())
        cfg["num_nextn_predict_layers"] = 1
        (dst / "config.json").write_text(json.dumps(cfg))
        return out

    ops = resolve(detect_platform("cpu"))
    model = load_model(with_mtp(tmp_path / "mtp"), dtype=torch.float32, device="cpu", ops=ops).model
    layer = model.mtp.layers[0]
    saved = load_file(tmp_path / "mtp" / "model.safetensors")
    assert torch.equal(layer.block.self_attn.kv_b_proj.weight, saved["model.layers.3.self_attn.kv_b_proj.weight"])
    assert torch.equal(layer.eh_proj.weight, saved["model.layers.3.eh_proj.weight"])
    assert torch.equal(layer.shared_head.head.weight, saved["model.layers.3.shared_head.head.weight"])
    assert len(model.kv_specs("float32")) == 3  # the step's cache: the main layers only
    ids = prompts(1)[0]
    main_logits = _prefill(model, ids)
    _, hf = checkpoints["v3"]
    with torch.no_grad():
        assert (main_logits[-1] - hf(torch.tensor([ids])).logits[0, -1]).abs().max() < 1e-4
    n = len(ids)
    caches = allocate_caches(CacheLayout((layer.block.self_attn.kv_spec("float32"),)), 4, BLOCK, 1, "cpu")
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange(4, dtype=torch.int32)[None],
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n, max_seq_len=n)
    with torch.inference_mode():
        hidden = layer(torch.tensor(ids), torch.arange(n), torch.randn(n, h), caches[0], meta)
        assert layer.compute_logits(hidden).shape == (n, VOCAB)
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.3\.eh_proj\.weight"):
        load_model(with_mtp(tmp_path / "cut", drop="model.layers.3.eh_proj.weight"), dtype=torch.float32,
                   device="cpu", ops=ops)


def build_hf_layers(kind: str, layers: int):
    cfg = tiny_config(kind)
    cfg.num_hidden_layers = layers
    torch.manual_seed(3)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_bf16_triton_and_cuda_graphs(kind, checkpoints):
    """On the GPU's own op table (Triton MLA kernels) in bfloat16: last-position logits near transformers' bf16,
    and greedy tokens with CUDA graphs equal to eager ones (the same kernels, replayed)."""
    path, hf = checkpoints[kind]
    ids = decisive_prompts(hf, 1)[0]
    model = load_model(path, dtype=torch.bfloat16, device="cuda", ops=resolve(detect_platform("cuda"))).model
    assert model.ops.chosen("mla_paged_attention") == "triton.default"
    n = len(ids)
    nb = -(-n // BLOCK)
    caches = allocate_caches(CacheLayout(tuple(model.kv_specs("bfloat16"))), nb, BLOCK, 1, "cuda")
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device="cuda"),
                             block_tables=torch.arange(nb, dtype=torch.int32, device="cuda")[None],
                             seq_lens=torch.tensor([n], dtype=torch.int32, device="cuda"),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32, device="cuda"),
                             max_query_len=n, max_seq_len=n)
    with torch.inference_mode():
        ours = model.compute_logits(model(torch.tensor(ids, device="cuda"), torch.arange(n, device="cuda"), caches,
                                          meta))[-1].float().cpu()
        peer = copy.deepcopy(hf).to("cuda", torch.bfloat16)  # a copy: the fixture's float32 model stays as it is
        theirs = peer(torch.tensor([ids], device="cuda")).logits[0, -1].float().cpu()
    del peer
    assert (ours - theirs).abs().max() <= 3e-2 * theirs.abs().max()
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    eager = LLM(path, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts(), params, use_tqdm=False)]
    del eager
    graphs = LLM(path, dtype="bfloat16", gpu_memory_utilization=0.3)
    assert graphs.engine.runner.graphs is not None
    assert [o.outputs[0].token_ids for o in graphs.generate(prompts(), params, use_tqdm=False)] == want


def test_a_gpu_fusion_plan_changes_nothing(checkpoints):
    """Built with every decode fusion a GPU's plan holds (one-row projections, pre-norms inside projections; served
    here by the reference ops), batch-1 decode gives the plain model's logits: the latent block takes the normed
    tensor, the MoE and dense blocks the pending norm."""
    from turnout.layers.fusion import FusionPlan

    path, _ = checkpoints["v3"]
    ops = resolve(detect_platform("cpu"))
    plan = FusionPlan(one_row_linear=True, prenorm_linear=True, prenorm_pays=lambda n, k: True, rope_attention=True)
    plain = load_model(path, dtype=torch.float32, device="cpu", ops=ops).model
    fused = load_model(path, dtype=torch.float32, device="cpu", ops=ops, plan=plan).model
    assert fused.model.layers[1].fuse_prenorms
    ids = prompts(1, seed=4)[0]
    logits = []
    for model in (plain, fused):
        layout = CacheLayout(tuple(model.kv_specs("float32")))
        caches = allocate_caches(layout, 4, BLOCK, 1, "cpu")
        table = torch.arange(4, dtype=torch.int32)[None]
        out = []
        with torch.inference_mode():
            for pos, tok in enumerate(ids):  # one token a step: every step is a one-row decode
                meta = AttentionMetadata(slot_mapping=torch.tensor([pos]), block_tables=table,
                                         seq_lens=torch.tensor([pos + 1], dtype=torch.int32),
                                         query_start_loc=torch.tensor([0, 1], dtype=torch.int32), max_query_len=1,
                                         max_seq_len=pos + 1)
                out.append(model.compute_logits(model(torch.tensor([tok]), torch.tensor([pos]), caches, meta))[0])
        logits.append(torch.stack(out))
    assert (logits[0] - logits[1]).abs().max() <= 1e-5 * logits[0].abs().max()


def test_batch_invariant_mode_is_refused_by_name(checkpoints):
    path, _ = checkpoints["v2_lite"]
    with pytest.raises(ValueError, match="batch_invariant"):
        LLM(path, batch_invariant=True, **KW)


def test_weight_updates_reach_the_absorbed_projections(checkpoints, tmp_path):
    """An RL weight update (``update_weights``, in place) of every tensor of another checkpoint gives that
    checkpoint's logits: W_UK / W_UV are views of kv_b_proj, so the absorbed attention sees the new weights."""
    from safetensors.torch import load_file

    from turnout.models.weight_map import update_weights

    path, _ = checkpoints["v3"]
    other = build_hf("v3", seed=7)
    other.save_pretrained(tmp_path)
    ops = resolve(detect_platform("cpu"))
    model = load_model(path, dtype=torch.float32, device="cpu", ops=ops).model
    ids = prompts(1)[0]
    before = _prefill(model, ids)[-1]
    update_weights(model, load_file(tmp_path / "model.safetensors").items())
    after = _prefill(model, ids)[-1]
    with torch.no_grad():
        want = other(torch.tensor([ids])).logits[0, -1]
    assert (before - want).abs().max() > 1e-2  # the two checkpoints differ
    assert (after - want).abs().max() <= 1e-4 * want.abs().max()
