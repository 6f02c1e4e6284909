"""Dense models (Llama, Mistral, Qwen2, Qwen3) through load_model vs transformers, logits at every
position: one batched prefill of mixed-length prompts, then one decode step over the paged cache."""

from __future__ import annotations

import math
import os

import pytest
import torch
import transformers

from turnout.layers.attention import AttentionMetadata
from turnout.loader import default_model_path, load_model
from turnout.ops import resolve
from turnout.platforms.detect import detect_platform

BLOCK = 16
PROMPT_LENS = [5, 17, 9]  # 17 crosses a block boundary


@pytest.fixture(scope="module")
def cpu_ops():
    return resolve(detect_platform("cpu"))


def _tiny(kind: str):
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    if kind == "llama":  # tied head, llama3 rope scaling, biases everywhere
        return transformers.LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if kind == "mistral":
        return transformers.MistralConfig(**common, head_dim=32, sliding_window=None, tie_word_embeddings=False)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6)
    if kind == "qwen3":  # head_dim != hidden / heads
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    raise AssertionError(kind)


def _randomise(hf_model, seed: int) -> None:
    """HF initialises biases to 0 and norms to 1; random values make every parameter count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.05
            p.copy_((1.0 + 2 * noise) if "norm" in name else 2 * noise)


def make_hf_model(kind: str, tmp_path, sharded: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    config = _tiny(kind)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomise(hf, seed)
    kwargs = {"max_shard_size": "60KB"} if sharded else {}
    hf.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    return hf


def prefill_meta(lens: list[int], device, extra: int = 1):
    """Contiguous blocks per sequence, room for ``extra`` more tokens each."""
    mb = max(math.ceil((n + extra) / BLOCK) for n in lens)
    block_tables = torch.arange(len(lens) * mb, dtype=torch.int32).view(len(lens), mb)
    slots = [block_tables[b, i // BLOCK].item() * BLOCK + i % BLOCK for b, n in enumerate(lens) for i in range(n)]
    positions = [i for n in lens for i in range(n)]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device), seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_query_len=max(lens), max_seq_len=max(lens))
    return meta, torch.tensor(positions, device=device), len(lens) * mb


def decode_meta(lens: list[int], block_tables: torch.Tensor, device):
    """One new token per sequence at position lens[b] (the cache holds lens[b] tokens)."""
    slots = [block_tables[b, n // BLOCK].item() * BLOCK + n % BLOCK for b, n in enumerate(lens)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_tables=block_tables,
        seq_lens=torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=device),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=max(lens) + 1)
    return meta, torch.tensor(lens, device=device)


def kv_caches(config, num_blocks: int, dtype, device):
    hk = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return [(torch.zeros(num_blocks, BLOCK, hk, d, dtype=dtype, device=device),
             torch.zeros(num_blocks, BLOCK, hk, d, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def run_prefill_and_decode(model, config, prompts: list[torch.Tensor], device, dtype):
    """Our logits for every prompt position, then for one decoded token per sequence."""
    lens = [len(p) for p in prompts]
    meta, positions, nb = prefill_meta(lens, device)
    caches = kv_caches(config, nb, dtype, device)
    with torch.inference_mode():
        hidden = model(torch.cat(prompts).to(device), positions, caches, meta)
        prefill_logits = model.compute_logits(hidden)  # [sum(lens), V]
        next_ids = torch.stack([prefill_logits[e - 1].argmax() for e in meta.query_start_loc[1:].tolist()])
        dmeta, dpos = decode_meta(lens, meta.block_tables, device)
        decode_logits = model.compute_logits(model(next_ids, dpos, caches, dmeta))  # [B, V]
    return prefill_logits.split(lens), next_ids.cpu(), decode_logits


@pytest.mark.parametrize("kind,sharded", [("llama", True), ("mistral", False), ("qwen2", False), ("qwen3", False)])
def test_dense_model_matches_hf(kind, sharded, tmp_path, cpu_ops):
    hf = make_hf_model(kind, tmp_path, sharded=sharded)
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), ops=cpu_ops)
    assert loaded.dtype == torch.float32 and loaded.max_model_len == 256
    assert type(loaded.model).__name__ == hf.config.architectures[0] or kind == "mistral"
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in PROMPT_LENS]
    prefill, next_ids, decode = run_prefill_and_decode(loaded.model, loaded.hf_config, prompts, "cpu", torch.float32)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            ref = hf(p[None]).logits[0]
            assert rel_err(prefill[b], ref) < 1e-4, f"prefill seq {b}"
            ext = torch.cat([p, next_ids[b: b + 1]])
            ref_next = hf(ext[None]).logits[0, -1]
            assert rel_err(decode[b], ref_next) < 1e-4, f"decode seq {b}"


def test_tied_head_shares_the_embedding(tmp_path, cpu_ops):
    make_hf_model("llama", tmp_path)
    model = load_model(str(tmp_path), device="cpu", ops=cpu_ops).model
    assert model.lm_head.weight is model.model.embed_tokens.weight


# ---- the embedded default: SmolLM2-135M-Instruct Q4_1 GGUF vs transformers' GGUF loading ----

@pytest.fixture(scope="module")
def smollm2_hf():
    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def test_smollm2_gguf_matches_hf(smollm2_hf, cpu_ops):
    loaded = load_model(None, device="cpu", ops=cpu_ops)
    tok = loaded.tokenizer
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    texts = ["The capital of France is", tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True)]
    prompts = [torch.tensor(tok(t)["input_ids"]) for t in texts]
    prefill, _, _ = run_prefill_and_decode(loaded.model, loaded.hf_config, prompts, "cpu", torch.float32)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            ref = smollm2_hf(p[None]).logits[0, -1]
            assert rel_err(prefill[b][-1], ref) < 1e-3, texts[b]
            assert prefill[b][-1].argmax() == ref.argmax()


# ---- GPU ----

@pytest.mark.gpu
def test_dummy_qwen3_0_6b_like_bf16_on_gpu():
    plat = detect_platform()
    ops, dev = resolve(plat), plat.device(0)
    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                      max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1e6,
                                      dtype="bfloat16")
    config.architectures = ["Qwen3ForCausalLM"]
    loaded = load_model(config, load_format="dummy", device=dev, ops=ops)
    assert loaded.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151936, (n,), generator=gen) for n in (7, 100, 33)]
    prefill, _, decode = run_prefill_and_decode(loaded.model, config, prompts, dev, torch.bfloat16)
    assert all(torch.isfinite(p).all() for p in prefill) and torch.isfinite(decode).all()
    assert prefill[0].dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_dense_model_matches_hf_bf16_on_gpu(kind, tmp_path):
    plat = detect_platform()
    ops, dev = resolve(plat), plat.device(0)
    hf = make_hf_model(kind, tmp_path)
    hf = hf.to(device=dev, dtype=torch.bfloat16)
    loaded = load_model(str(tmp_path), device=dev, ops=ops, dtype="bfloat16")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in PROMPT_LENS]
    prefill, next_ids, decode = run_prefill_and_decode(loaded.model, loaded.hf_config, prompts, dev, torch.bfloat16)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            assert rel_err(prefill[b], hf(p[None].to(dev)).logits[0]) < 3e-2, f"prefill seq {b}"
            ext = torch.cat([p, next_ids[b: b + 1]])[None].to(dev)
            assert rel_err(decode[b], hf(ext).logits[0, -1]) < 3e-2, f"decode seq {b}"


def test_qwen3_through_the_triton_kernels_matches_hf(tmp_path):
    """The Triton implementations in a whole q/k-norm model (the interpreter on CPU): qk_norm_rotary_cache
    writes the cache that paged attention then reads, so a wrong slot or head shows in the decode logits."""
    from turnout.ops import Policy

    platform = detect_platform("cpu")
    if not platform.triton_usable():
        pytest.skip("Triton does not run here")
    ops = resolve(platform, Policy.parse("prefer=triton"))
    for op in ("qk_norm_rotary_cache", "paged_attention", "fused_add_rms_norm"):
        assert ops.chosen(op) == "triton.default", op
    hf = make_hf_model("qwen3", tmp_path, seed=3)
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), ops=ops)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in PROMPT_LENS]
    prefill, next_ids, decode = run_prefill_and_decode(loaded.model, loaded.hf_config, prompts, "cpu", torch.float32)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            assert rel_err(prefill[b], hf(p[None]).logits[0]) < 1e-4, f"prefill seq {b}"
            ref_next = hf(torch.cat([p, next_ids[b: b + 1]])[None]).logits[0, -1]
            assert rel_err(decode[b], ref_next) < 1e-4, f"decode seq {b}"
