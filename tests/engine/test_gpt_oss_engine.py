"""A tiny GPT-OSS (sliding layers of 6 tokens alternating with full ones, sinks, the biased clamped-SwiGLU experts)
served by the whole engine far past its window, with chunked prefill in chunks of 8 tokens (so chunks straddle the
window's edge) and prefix caching (two prompts sharing 9 tokens, then the same prompts again: prefix hits across
window boundaries): greedy tokens equal to transformers' and every step's top logprobs within 1e-4 of HF's
log-softmax over the same tokens, every time."""

from __future__ import annotations

import torch
import transformers

from turnout import LLM, SamplingParams

WINDOW, BS, STEPS = 6, 4, 24
# transformers 5.17's GptOssConfig has no swiglu_limit and its experts clamp at the released 7.0 whatever the config
# says; newer ones read the field (3.0 lets the tiny random weights reach the clamp)
LIMIT = 3.0 if "swiglu_limit" in transformers.GptOssConfig().to_dict() else 7.0


def _model(path):
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=256, swiglu_limit=LIMIT, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 0.6 if "gate_up" in name else 0.2 if "experts" in name else 1.0 if "sinks" in name else 0.1
            noise = scale * torch.randn(p.shape, generator=gen)
            p.copy_(p + noise if "norm" in name else noise)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def _prompts():
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 256, (9,), generator=g).tolist()  # a shared prefix longer than the window
    return [shared + torch.randint(0, 256, (5,), generator=g).tolist(), shared + [7]]


def test_gpt_oss_engine_chunked_prefill_and_prefix_hits_match_hf(tmp_path):
    hf = _model(tmp_path)
    reference = []
    with torch.no_grad():
        for p in _prompts():
            ids = torch.tensor([p])
            tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=STEPS,
                                 min_new_tokens=STEPS)[0, len(p):].tolist()
            logits = hf(torch.tensor([p + tokens])).logits[0, len(p) - 1: -1]
            reference.append((tokens, torch.log_softmax(logits.double(), -1)))
    llm = LLM(str(tmp_path), device="cpu", block_size=BS, max_num_batched_tokens=8, max_num_seqs=2,
              enable_prefix_caching=True, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    try:
        for round_ in range(2):  # the second round starts from the first's cached blocks
            outs = llm.generate(_prompts(), params, use_tqdm=False)
            for out, (tokens, ref_lp) in zip(outs, reference):
                got = out.outputs[0]
                assert got.token_ids == tokens, f"round {round_}"
                assert len(set(tokens)) > STEPS // 6  # a varied continuation, so equal tokens say something
                for i, lp in enumerate(got.logprobs):
                    for tok, entry in lp.items():
                        assert abs(entry.logprob - float(ref_lp[i, tok])) < 1e-4, (round_, i, tok)
        assert llm.engine.scheduler.num_prefix_cached_tokens >= 2 * 8  # whole blocks of both prompts, hit
    finally:
        llm.engine.executor.shutdown()
