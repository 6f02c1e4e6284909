"""GGUF files of the sandwich-norm and fused families (Gemma 2, Gemma 3, Phi-3) against transformers' own GGUF loading.

A tiny random HF model is written as an F32 GGUF laid out as llama.cpp's converter lays it out: Gemma's RMSNorm
weights stored as 1 + w under llama.cpp's names (``ffn_norm`` is the norm before the MLP, ``post_attention_norm`` and
``post_ffw_norm`` the ones after), Phi-3's fused ``attn_qkv`` and ``ffn_up`` ([gate; up]) rows. transformers reads
the file back with its own GGUF support: its state dict must equal the original (so the file is right), turnout's
``iter_gguf_weights`` must yield exactly the same tensors, and the whole engine serving the file must give the greedy
tokens and logprobs of transformers' model loaded from it (the config both read from the GGUF metadata: a window
shorter than the prompts, so the sliding layers count).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

GGUFWriter = pytest.importorskip("gguf").GGUFWriter
pytest.importorskip("accelerate")  # transformers' GGUF loading needs it

from test_gguf_vs_hf import _write_gguf  # noqa: E402  (the same directory: llama.cpp's layout per arch)
from turnout import LLM, SamplingParams  # noqa: E402
from turnout.loader.gguf import iter_gguf_weights  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
WINDOW, STEPS = 8, 16
SCALE = {"gemma2": 0.5, "gemma3": 0.5, "phi3": 0.2}


def _config(arch: str):
    if arch == "gemma2":  # alternating sliding and global layers, soft-capping: transformers' defaults
        return transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW)
    if arch == "gemma3":  # five sliding layers to one global one (the default pattern): 6 layers
        return transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, head_dim=16,
                                             sliding_window=WINDOW)
    if arch == "phi3":
        return transformers.Phi3Config(**COMMON, pad_token_id=0, tie_word_embeddings=False)
    raise AssertionError(arch)


def _prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(1, 128, (11,), generator=g).tolist()  # longer than the window
    return [shared + torch.randint(1, 128, (4,), generator=g).tolist(), shared + [5]]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_gguf_family_matches_transformers_tensors_and_tokens(arch, tmp_path):
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(_config(arch)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights drawn large enough for a varied continuation, embedding rows of equal norm (a
        for name, p in original.named_parameters():  # tied head would else favour the longest row), in
            w = (0.2 if "norm" in name else SCALE[arch]) * torch.randn(p.shape, generator=gen)  # multiples of
            if "embed" in name and original.config.tie_word_embeddings:  # 1/1024, which the file's (w + 1) - 1 for Gemma's norms keeps exactly
                w = 0.5 * w / w.norm(dim=-1, keepdim=True)
            p.copy_((w * 1024).round() / 1024)
    _write_gguf(original, arch, tmp_path / "tiny.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                           dtype=torch.float32, attn_implementation="eager").eval()
    ref = hf.state_dict()
    for name, t in original.state_dict().items():
        assert torch.equal(ref[name], t), f"the test's GGUF writer and transformers disagree on {name}"
    ours = dict(iter_gguf_weights(tmp_path / "tiny.gguf", hf.config))
    expected = {k: v for k, v in ref.items() if not (k == "lm_head.weight" and "lm_head.weight" not in ours)}
    assert set(ours) == set(expected)
    for name, t in expected.items():
        assert torch.equal(ours[name], t), name

    reference = []
    with torch.no_grad():
        for p in _prompts():
            tokens = []  # greedy by hand: generate's min_new_tokens would mask the end-of-sequence token
            for _ in range(STEPS):
                tokens.append(int(hf(torch.tensor([p + tokens])).logits[0, -1].argmax()))
            logits = hf(torch.tensor([p + tokens])).logits[0, len(p) - 1: -1]
            reference.append((tokens, torch.log_softmax(logits.double(), -1)))
    llm = LLM(str(tmp_path / "tiny.gguf"), device="cpu", block_size=4, max_num_batched_tokens=8, max_num_seqs=2,
              enable_prefix_caching=True, dtype="float32")
    seen = set()
    try:
        outs = llm.generate(_prompts(),
                            SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=3),
                            use_tqdm=False)
        for out, (tokens, ref_lp) in zip(outs, reference):
            got = out.outputs[0]
            assert got.token_ids == tokens
            seen.update(tokens)
            for i, lp in enumerate(got.logprobs):
                for tok, entry in lp.items():
                    assert abs(entry.logprob - float(ref_lp[i, tok])) < 1e-4, (i, tok)
        assert len(seen) > 4  # varied continuations, so equal tokens say something
    finally:
        llm.engine.executor.shutdown()


def test_phi3_gguf_with_longrope_factors_is_refused(tmp_path):
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(_config("phi3")).eval()
    w = GGUFWriter(str(tmp_path / "long.gguf"), "phi3")
    w.add_block_count(2)
    w.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    w.add_tensor("token_embd.weight", original.model.embed_tokens.weight.detach().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="rope_factors_long.*LongRoPE|LongRoPE.*rope_factors_long"):
        list(iter_gguf_weights(tmp_path / "long.gguf", original.config))


def test_kept_q4_blocks_are_refused_for_a_layout_they_are_not_built_for(tmp_path):
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(_config("gemma2")).eval()
    _write_gguf(original, "gemma2", tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match="quantization='gguf'.*'gemma2'"):
        list(iter_gguf_weights(tmp_path / "tiny.gguf", original.config, keep_q4=True))
