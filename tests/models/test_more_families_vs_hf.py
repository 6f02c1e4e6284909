"""ERNIE-4.5 dense and MoE, Phi-3 (fused qkv / gate_up checkpoints, a window on every layer, partial rope) and
Phi-3 with LongRoPE, against transformers on tiny random models: on three prompts, 32 greedy tokens identical to
HF's ``generate`` and every step's logits within 1e-4 of HF's forward over the same tokens.

The tiny configs make every part count: ERNIE's rope on interleaved pairs (a rotate-half rope fails), biases on
every dense projection, MoE layers only where start / end / interval put them, an aux-free correction bias large
enough to change which experts are chosen, shared experts; Phi-3's window far shorter than the generation, rope
on half of each head, LongRoPE whose long factors differ from its short ones, with prompts longer than
``original_max_position_embeddings`` (transformers then rotates every position with the long factors).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from test_composed_families_vs_hf import greedy
from test_dense_vs_hf import rel_err
from turnout.loader import load_model
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

VOCAB = 256
STEPS = 32
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6)
LONGROPE_ORIGINAL = 24  # the prompts below are longer: transformers runs the long factors throughout


def tiny_config(kind: str):
    if kind == "ernie":
        return transformers.Ernie4_5Config(**COMMON, num_hidden_layers=2, head_dim=16, use_bias=True,
                                           tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                      "rope_theta": 500000.0})
    if kind == "ernie_moe":  # layers 1 and 2 sparse; 0 (before the start index) and 3 (past the end index) dense
        return transformers.Ernie4_5_MoeConfig(
            **COMMON, num_hidden_layers=4, head_dim=16, moe_num_experts=8, moe_k=3, moe_intermediate_size=32,
            moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1,
            tie_word_embeddings=False)
    if kind == "phi3":  # Phi-4-mini's shape of rope: the first half of each head rotated
        return transformers.Phi3Config(**COMMON, num_hidden_layers=2, sliding_window=12, pad_token_id=0, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5})
    if kind == "phi3_longrope":
        gen = torch.Generator().manual_seed(11)
        half = 64 // 4 // 2  # head_dim 16: 8 frequencies
        return transformers.Phi3Config(
            **COMMON, num_hidden_layers=2, pad_token_id=0, tie_word_embeddings=False,
            original_max_position_embeddings=LONGROPE_ORIGINAL,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                             "original_max_position_embeddings": LONGROPE_ORIGINAL,
                             "short_factor": (1 + torch.rand(half, generator=gen)).tolist(),
                             "long_factor": (2 + 8 * torch.rand(half, generator=gen)).tolist()})
    raise AssertionError(kind)


def _randomise(hf_model, seed: int) -> None:
    """Norms 1 + noise; weights at a 1/sqrt(fan-in) scale so routing is decisive; a correction bias of the
    softmax scores' own size, so it changes which experts are chosen."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 1.5 * p.shape[-1] ** -0.5))


def make(kind: str, path, seed: int = 0):
    torch.manual_seed(seed)
    config = tiny_config(kind)
    config.eos_token_id = None  # the engine side ignores EOS; HF would stop or hold it back
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    _randomise(hf, seed)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


@pytest.fixture(scope="module")
def cpu_ops():
    return resolve(detect_platform("cpu"))


def _prompts(kind: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lens = (30, 41, 27) if kind == "phi3_longrope" else (5, 17, 9)  # all past LONGROPE_ORIGINAL for LongRoPE
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lens]


@pytest.mark.parametrize("kind", ["ernie", "ernie_moe", "phi3", "phi3_longrope"])
def test_greedy_32_tokens_and_logits_match_hf(kind, tmp_path, cpu_ops):
    hf = make(kind, tmp_path, seed=1)
    loaded = load_model(str(tmp_path), device="cpu", ops=cpu_ops)
    assert type(loaded.model).__name__ == hf.config.architectures[0]
    for i, prompt in enumerate(_prompts(kind, seed=2)):
        tokens, logits = greedy(loaded.model, loaded.hf_config, prompt, STEPS)
        with torch.no_grad():
            ref = hf.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=STEPS, min_new_tokens=STEPS)[0, len(prompt):]
            full = hf(torch.cat([prompt, torch.tensor(tokens)])[None]).logits[0, len(prompt) - 1: -1]
        assert tokens == ref.tolist(), f"prompt {i}"
        assert len(set(tokens)) > STEPS // 4, f"prompt {i}: a varied continuation, so equal tokens say something"
        for s in range(STEPS):
            assert rel_err(logits[s], full[s]) < 1e-4, f"prompt {i} step {s}"


@pytest.mark.parametrize("start,end,interval", [(1, -1, 1), (1, 2, 1), (0, 4, 2), (2, 4, 3), (3, 5, 2)])
def test_ernie_moe_layers_are_where_transformers_puts_them(start, end, interval, cpu_ops):
    """Which layers have routed experts (start index, end index, interval), against transformers' own layers."""
    from turnout.layers.moe.layer import SparseMoeBlock
    from turnout.models.registry import get_model_class

    config = tiny_config("ernie_moe")
    config.num_hidden_layers, config.moe_layer_start_index = 6, start
    config.moe_layer_end_index, config.moe_layer_interval = end, interval
    config = transformers.Ernie4_5_MoeConfig(**config.to_dict())  # __post_init__ resolves end -1
    with torch.device("meta"):
        theirs = transformers.Ernie4_5_MoeForCausalLM(config)
        ours = get_model_class(["Ernie4_5_MoeForCausalLM"])(config, cpu_ops)
    want = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in theirs.model.layers]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == want
    assert any(want) and not all(want)


@pytest.mark.parametrize("kind", ["ernie", "ernie_moe", "phi3"])
def test_through_the_triton_kernels_with_a_gpus_plan_matches_hf(kind, tmp_path):
    """The Triton implementations (the interpreter on CPU) with every decode fusion of a GPU's plan: a batched
    prefill and a decode step of two prompts, then two steps at batch 1, within 1e-4 of transformers. ERNIE's interleaved rope and Phi-3's
    half-head rope with its window inside the fused decode attention kernel, ERNIE MoE's float32 router with the
    correction bias and k = 3 in the routing kernel, the grouped expert kernels."""
    from test_dense_vs_hf import run_prefill_and_decode
    from turnout.layers.fusion import FusionPlan
    from turnout.ops import Policy

    platform = detect_platform("cpu")
    if not platform.triton_usable()[0]:
        pytest.skip("Triton does not run here")
    ops = resolve(platform, Policy.parse("prefer=triton"))
    for op in ("rotary_paged_attention", "paged_attention", "rotary_embedding", "select_experts", "moe_experts",
               "add_rms_norm_linear", "small_m_linear"):
        assert ops.chosen(op) == "triton.default", op
    hf = make(kind, tmp_path, seed=3)
    plan = FusionPlan(one_row_linear=True, prenorm_linear=True, prenorm_pays=lambda n, k: True, rope_attention=True)
    loaded = load_model(str(tmp_path), device="cpu", ops=ops, plan=plan)
    prompts = _prompts(kind, seed=4)[:2]  # 5 and 17 tokens: the latter crosses a KV block and Phi-3's window
    prefill, next_ids, decode = run_prefill_and_decode(loaded.model, loaded.hf_config, prompts, "cpu", torch.float32)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            assert rel_err(prefill[b], hf(p[None]).logits[0]) < 1e-4, f"prefill seq {b}"
            ref_next = hf(torch.cat([p, next_ids[b: b + 1]])[None]).logits[0, -1]
            assert rel_err(decode[b], ref_next) < 1e-4, f"decode seq {b}"
    # one row: the pre-norms computed inside the one-row projections (add_rms_norm_linear, small_m_linear)
    tokens, logits = greedy(loaded.model, loaded.hf_config, prompts[0], 2)
    with torch.no_grad():
        full = hf(torch.cat([prompts[0], torch.tensor(tokens)])[None]).logits[0, len(prompts[0]) - 1: -1]
    for s in range(2):
        assert rel_err(logits[s], full[s]) < 1e-4, f"batch-1 step {s}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ernie", "ernie_moe", "phi3", "phi3_longrope"])
def test_bf16_on_gpu_matches_hf(kind, tmp_path):
    """bf16 through the platform's kernels and the GPU's fusion plan (one-row projections with fused pre-norms,
    rope and the window inside the decode attention kernel, the routing and expert kernels): every step's logits of
    a 32-token greedy generation within 5e-2 (mean 2e-2) of HF's float32 forward over the same tokens, or within
    1.5 times HF's own bf16 error where that is larger."""
    from test_dense_vs_hf import decode_meta, kv_caches, prefill_meta
    from turnout.layers.fusion import plan_fusions

    plat = detect_platform()
    ops, dev = resolve(plat), plat.device(0)
    hf = make(kind, tmp_path, seed=1).to(device=dev)
    loaded = load_model(str(tmp_path), device=dev, ops=ops, dtype="bfloat16", plan=plan_fusions(ops))
    prompt = _prompts(kind, seed=2)[1].to(dev)
    meta, positions, nb = prefill_meta([len(prompt)], dev, extra=STEPS)
    caches = kv_caches(loaded.hf_config, nb, torch.bfloat16, dev)
    model = loaded.model
    with torch.inference_mode():
        logits = [model.compute_logits(model(prompt, positions, caches, meta))[-1]]
        tokens = [int(logits[-1].argmax())]
        for _ in range(STEPS - 1):
            dmeta, dpos = decode_meta([len(prompt) + len(tokens) - 1], meta.block_tables, dev)
            logits.append(model.compute_logits(model(torch.tensor(tokens[-1:], device=dev), dpos, caches, dmeta))[0])
            tokens.append(int(logits[-1].argmax()))
    ids = torch.cat([prompt, torch.tensor(tokens, device=dev)])[None]
    with torch.no_grad():
        full = hf(ids).logits[0, len(prompt) - 1: -1]
        hf_bf16 = hf.to(torch.bfloat16)(ids).logits[0, len(prompt) - 1: -1]  # HF's own bf16 error, the yardstick
    errs = [rel_err(logits[i], full[i]) for i in range(STEPS)]
    theirs = [rel_err(hf_bf16[i], full[i]) for i in range(STEPS)]
    # an expert chosen differently in bf16 (a near tie) moves a step's logits for HF's bf16 as for ours
    assert all(e <= max(5e-2, 1.5 * h) for e, h in zip(errs, theirs, strict=True)), \
        [(round(e, 4), round(h, 4)) for e, h in zip(errs, theirs, strict=True)]
    assert sum(errs) / STEPS <= max(2e-2, 1.5 * sum(theirs) / STEPS)


def test_ernie_router_matches_transformers_router(cpu_ops):
    """ERNIE-4.5's routing against transformers' ``Ernie4_5_MoeTopKRouter`` on 64 tokens: the same experts in the
    same order and the same weights, with a correction bias that changes the choice (without it, other experts)."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    from turnout.layers.moe.layer import Router
    from turnout.layers.moe.router import RoutingConfig

    config = tiny_config("ernie_moe")
    gen = torch.Generator().manual_seed(0)
    theirs = Ernie4_5_MoeTopKRouter(config)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(theirs.weight.shape, generator=gen) * 0.3)
        theirs.moe_statics.e_score_correction_bias.copy_(torch.randn(1, 8, generator=gen) * 0.1)
    ours = Router(64, RoutingConfig.from_hf_config(config), logits_fp32=True, ops=cpu_ops)
    tensors = {"weight": theirs.weight, "e_score_correction_bias": theirs.moe_statics.e_score_correction_bias}
    for name, tensor in tensors.items():
        param = getattr(ours, name)
        param.weight_loader(param, tensor.detach())
    x = torch.randn(64, 64, generator=gen)
    _, want_w, want_ids = theirs(x)
    w, ids = ours(x)
    assert torch.equal(ids.long(), want_ids) and torch.allclose(w, want_w, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        theirs.moe_statics.e_score_correction_bias.zero_()
    assert not torch.equal(theirs(x)[2], want_ids)  # the bias mattered


@pytest.mark.parametrize("max_position", [LONGROPE_ORIGINAL, 256])
def test_longrope_cache_is_transformers_short_or_long_rope(max_position, cpu_ops):
    """The cos/sin cache equals transformers' Phi-3 rotary embedding for a sequence of the model's whole context:
    the short factors for a model built for the original length, the long ones past it (with the attention
    factor of max / original positions either way)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from turnout.layers.rotary import get_rope

    config = tiny_config("phi3_longrope")
    config.max_position_embeddings = max_position
    rope = get_rope(config, 16, max_position, cpu_ops)
    positions = torch.arange(max_position)[None]
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, 16]
    assert torch.allclose(rope.cos_sin_cache, torch.cat([cos[0, :, :8], sin[0, :, :8]], -1), rtol=1e-6, atol=1e-6)
    short = Phi3RotaryEmbedding(config)(torch.zeros(1), positions[:, :LONGROPE_ORIGINAL])[0]
    uses_long = not torch.allclose(rope.cos_sin_cache[:LONGROPE_ORIGINAL, :8], short[0, :, :8])
    assert uses_long == (max_position > LONGROPE_ORIGINAL)


def test_phi3_packed_checkpoint_equals_the_same_weights_split_also_in_fp8(tmp_path, cpu_ops):
    """A full-rope, windowless Phi-3 is Llama with packed tensors: its checkpoint and the same weights split into
    q/k/v and gate/up as a Llama checkpoint give bit-identical logits, unquantised and with online fp8 (the packed
    tensor quantised per row and loaded through the same packed loader)."""
    config = transformers.Phi3Config(**COMMON, num_hidden_layers=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    phi = transformers.Phi3ForCausalLM(config).eval()
    _randomise(phi, 1)
    phi.save_pretrained(tmp_path / "phi3", safe_serialization=True)
    split = {}
    for name, tensor in phi.state_dict().items():
        if ".qkv_proj." in name:
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([64, 32, 32]), strict=True):
                split[name.replace("qkv_proj", part)] = rows
        elif ".gate_up_proj." in name:
            for part, rows in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
                split[name.replace("gate_up_proj", part)] = rows
        else:
            split[name] = tensor
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, num_hidden_layers=2,
                                                                    tie_word_embeddings=False))
    llama.load_state_dict(split, strict=True)
    llama.save_pretrained(tmp_path / "llama", safe_serialization=True)
    prompt = _prompts("phi3", seed=2)[1]
    for quantization in (None, "fp8"):
        logits = [greedy(load_model(str(tmp_path / kind), device="cpu", ops=cpu_ops, quantization=quantization).model,
                         transformers.AutoConfig.from_pretrained(tmp_path / kind), prompt, 3)[1]
                  for kind in ("phi3", "llama")]
        assert torch.equal(logits[0], logits[1]), quantization
