"""The families the decoder composes from declared parts (Gemma 2, Gemma 3 text, Mistral with a window) against
transformers on tiny random models: logits of a batched prefill and a decode step, then greedy generation,
within windows and far past them.

Each tiny config makes every part count: Gemma's soft-caps are small enough to bite (random weights give small
scores), ``query_pre_attn_scalar`` differs from head_dim, windows are a few tokens, Gemma 3's global layers use a
linearly scaled rope with another base than its sliding ones. ``_randomise`` moves every norm weight off its
initial value, so a (1 + w) norm read as w (or the reverse) shows.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from test_dense_vs_hf import BLOCK, decode_meta, kv_caches, prefill_meta, rel_err, run_prefill_and_decode
from turnout.loader import load_model
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6)


def tiny_config(kind: str, window: int = 64, tied: bool = True):
    if kind == "gemma2":  # sliding, full, sliding, full
        return transformers.Gemma2Config(**COMMON, num_hidden_layers=4, head_dim=16, sliding_window=window,
                                         query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=3.0, tie_word_embeddings=tied)
    if kind == "gemma3":  # two sliding layers, then a global one with its own (scaled) rope
        return transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=3, head_dim=16, sliding_window=window, query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"], tie_word_embeddings=False,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if kind == "mistral":  # the window on every layer
        return transformers.MistralConfig(**COMMON, num_hidden_layers=2, head_dim=16, sliding_window=window,
                                          tie_word_embeddings=False)
    raise AssertionError(kind)


def _randomise(hf_model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            # a norm keeps its initial value (Gemma's w = 0, scaling by 1 + w; others 1) plus the noise
            p.copy_(p + noise if "norm" in name else noise)


@pytest.fixture(scope="module")
def cpu_ops():
    return resolve(detect_platform("cpu"))


def make(kind: str, tmp_path, window: int = 64, seed: int = 0, tied: bool = True):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, window, tied), dtype=torch.float32).eval()
    _randomise(hf, seed)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf


def greedy(model, config, prompt: torch.Tensor, steps: int):
    """Our greedy continuation of ``prompt``: a prefill, then ``steps - 1`` one-token decode steps over the
    paged cache. Returns (tokens, the logits each token was drawn from [steps, V])."""
    meta, positions, nb = prefill_meta([len(prompt)], "cpu", extra=steps)
    caches = kv_caches(config, nb, torch.float32, "cpu")
    with torch.inference_mode():
        logits = [model.compute_logits(model(prompt, positions, caches, meta))[-1]]
        tokens = [int(logits[-1].argmax())]
        for _ in range(steps - 1):
            n = len(prompt) + len(tokens) - 1  # tokens in the cache before this step
            dmeta, dpos = decode_meta([n], meta.block_tables, "cpu")
            logits.append(model.compute_logits(model(torch.tensor(tokens[-1:]), dpos, caches, dmeta))[0])
            tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "mistral"])
def test_prefill_and_decode_match_hf_inside_the_window(kind, tmp_path, cpu_ops):
    hf = make(kind, tmp_path)
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), ops=cpu_ops)
    assert type(loaded.model).__name__ == hf.config.architectures[0]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (5, 17, 9)]  # 17 crosses a KV block
    prefill, next_ids, decode = run_prefill_and_decode(loaded.model, loaded.hf_config, prompts, "cpu", torch.float32)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            assert rel_err(prefill[b], hf(p[None]).logits[0]) < 1e-4, f"prefill seq {b}"
            ref_next = hf(torch.cat([p, next_ids[b: b + 1]])[None]).logits[0, -1]
            assert rel_err(decode[b], ref_next) < 1e-4, f"decode seq {b}"


@pytest.mark.parametrize("kind,window", [("gemma2", 6), ("gemma3", 5), ("mistral", 16)])
def test_greedy_generation_far_past_the_window_matches_hf(kind, window, tmp_path, cpu_ops):
    """Windows of a few tokens, a generation several windows and KV blocks long: the same tokens as HF's greedy
    generate, and every step's logits within 1e-4 of HF's over the same tokens. (Gemma 2 untied here: a tied
    tiny Gemma repeats one token, which would make equal greedy tokens say little.)"""
    hf = make(kind, tmp_path, window=window, seed=2, tied=False)
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), ops=cpu_ops)
    prompt = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(3))
    steps = 3 * BLOCK + 5
    tokens, logits = greedy(loaded.model, loaded.hf_config, prompt, steps)
    with torch.no_grad():
        # an explicit mask: token 0 is Gemma's pad token, which generate would otherwise mask out of the prompt
        ref = hf.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
                          max_new_tokens=steps, min_new_tokens=steps)[0, len(prompt):]
        full = hf(torch.cat([prompt, torch.tensor(tokens)])[None]).logits[0, len(prompt) - 1: -1]
    assert tokens == ref.tolist()
    assert len(set(tokens)) > steps // 6  # a varied continuation, so the comparison says something
    for i in range(steps):
        assert rel_err(logits[i], full[i]) < 1e-4, f"step {i}"


def test_the_parts_each_family_is_built_from(tmp_path, cpu_ops):
    """What the configs above declare reaches the layers: windows per layer type, scales, caps, norms."""
    make("gemma2", tmp_path, window=6)
    model = load_model(str(tmp_path), device="cpu", ops=cpu_ops).model
    attn = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attn] == [6, None, 6, None]
    assert all(a.logit_softcap == 2.0 and a.scale == 24 ** -0.5 for a in attn)
    assert model.lm_head.softcap == 3.0 and model.lm_head.weight is model.model.embed_tokens.weight
    layer = model.model.layers[0]
    assert {n for n, _ in layer.named_children()} >= {"input_layernorm", "post_attention_layernorm",
                                                      "pre_feedforward_layernorm", "post_feedforward_layernorm"}
    assert layer.input_layernorm.unit_offset and type(layer.mlp.act_fn).__name__ == "GeluTanhAndMul"


def test_a_mistral_window_covering_every_position_is_no_window(cpu_ops):
    from turnout.models.registry import get_model_class

    config = tiny_config("mistral", window=4096)  # max_position_embeddings 256
    with torch.device("meta"):
        model = get_model_class(["MistralForCausalLM"])(config, cpu_ops)
    assert all(layer.self_attn.attn.sliding_window is None for layer in model.model.layers)


def test_unknown_layer_types_and_activations_are_refused(cpu_ops):
    from turnout.models.registry import get_model_class

    config = tiny_config("gemma2")
    config.layer_types = ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]
    with torch.device("meta"), pytest.raises(ValueError, match="layer_types.*chunked_attention"):
        get_model_class(["Gemma2ForCausalLM"])(config, cpu_ops)
    config = tiny_config("gemma2")
    config.hidden_activation = "gelu"
    with torch.device("meta"), pytest.raises(ValueError, match="hidden_activation 'gelu'"):
        get_model_class(["Gemma2ForCausalLM"])(config, cpu_ops)
