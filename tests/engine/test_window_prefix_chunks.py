"""Windowed families through the whole engine with prefix caching and chunked prefill, where both cross window
boundaries: tiny Gemma 2 (sliding and global layers, soft-caps), Gemma 3 (sliding and global layers, rope per
layer type), Mistral and Phi-3 (a window on every layer, whose blocks are released as they fall out of it),
windows of 5-8 tokens, KV blocks of 4, prefill chunks of 8 tokens. A first request computes a 21-token prompt; then two
requests reuse its blocks from the prefix cache (16 and 20 tokens: several windows deep) and prefill the rest
in chunks. Every request's greedy tokens equal transformers' ``generate`` on the same weights.
(tests/engine/test_sliding_window_engine.py: Mistral at TP=1 and 2 with bounded blocks, prompts inside one
window.)"""

from __future__ import annotations

import pytest
import torch
import transformers

from turnout import LLM, SamplingParams

BS, STEPS, VOCAB = 4, 24, 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _config(kind: str):
    if kind == "gemma2":  # sliding, full, sliding
        return transformers.Gemma2Config(**COMMON, num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=3, sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=8)
    if kind == "phi3":  # a window on every layer, rope on half of each head, packed checkpoint tensors
        return transformers.Phi3Config(**COMMON, num_hidden_layers=2, sliding_window=7, pad_token_id=0,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                        "partial_rotary_factor": 0.5})
    raise AssertionError(kind)


def _prompts():
    g = torch.Generator().manual_seed(5)
    first = torch.randint(0, VOCAB, (21,), generator=g).tolist()
    return first, [first[:18] + torch.randint(0, VOCAB, (5,), generator=g).tolist(), first + [3]]


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "mistral", "phi3"])
def test_prefix_hits_and_chunks_across_windows_match_hf(kind, tmp_path):
    torch.manual_seed(0)
    config = _config(kind)
    config.eos_token_id = None  # the engine ignores EOS; HF's generate would hold it back
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms keep their initial value (Gemma's 0, Mistral's 1) plus noise
        for name, p in hf.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(p + noise if "norm" in name else noise)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    first, later = _prompts()
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                           max_new_tokens=STEPS, min_new_tokens=STEPS)[0, len(p):].tolist() for p in (first, *later)]

    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=8, max_num_seqs=2,
              enable_prefix_caching=True)
    try:
        eng = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
        outs = {}

        def run(requests):
            for rid, p in requests:
                eng.add_request(rid, p, params)
            while eng.has_unfinished_requests():
                outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})

        run([("first", first)])
        assert eng.scheduler.num_prefix_cached_tokens == 0
        run([("b", later[0]), ("c", later[1])])
        window = min(a.sliding_window for a in (m.self_attn.attn for m in eng.runner.model.model.layers)
                     if a.sliding_window)
        # both later requests found blocks several windows deep: 16 tokens (4 blocks) and 20 (5 blocks)
        assert eng.scheduler.num_prefix_cached_tokens == 16 + 20 > 4 * window
        if kind in ("mistral", "phi3"):  # every layer sliding: the blocks behind the window went back
            assert eng.block_manager.num_window_released > 0
    finally:
        llm.engine.executor.shutdown()
    for rid, want in zip(("first", "b", "c"), ref, strict=True):
        assert list(outs[rid]) == want, rid
        assert len(set(want)) > STEPS // 6, rid  # a varied continuation, so equal tokens say something
