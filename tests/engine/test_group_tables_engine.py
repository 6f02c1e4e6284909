"""Per-group block tables (turnout/kv/group_blocks.py) through the whole engine: a tiny Gemma 3 (five sliding
layers of window 7 to one global, 6 layers) and a tiny GPT-OSS (sliding window 6 alternating with full layers),
KV blocks of 4, prefill chunks of 8 tokens, prefix caching (a shared 13-token prefix, then the same prompts
again), decoding far past the window, on a KV pool small enough that sequences are preempted (recompute and
swap). Greedy tokens equal transformers' ``generate`` on the same weights and every drawn token's top
logprobs are within 1e-4 of HF's log-softmax. Meanwhile, at every step, each decoding sequence holds
ceil(L / 4) full-group blocks and at most ceil(W / 4) + 1 blocks in each sliding group; when all requests are
done every block is back in the pool."""

from __future__ import annotations

import pytest
import torch
import transformers

from turnout import LLM, SamplingParams

BS, STEPS, VOCAB = 4, 30, 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
LIMIT = 3.0 if "swiglu_limit" in transformers.GptOssConfig().to_dict() else 7.0


def _config(kind: str):
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=6, sliding_window=7, rms_norm_eps=1e-6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    return transformers.GptOssConfig(
        **COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
        swiglu_limit=LIMIT, rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def _model(kind, path):
    torch.manual_seed(0)
    config = _config(kind)
    config.eos_token_id = None  # the engine ignores EOS; HF's generate would hold it back
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 0.6 if "gate_up" in name else 0.2 if "experts" in name else 1.0 if "sinks" in name else 0.1
            noise = scale * torch.randn(p.shape, generator=gen)
            p.copy_(p + noise if "norm" in name else noise)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def _prompts():
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, VOCAB, (13,), generator=g).tolist()  # two windows and a bit: hits across windows
    return [shared + torch.randint(0, VOCAB, (6,), generator=g).tolist(), shared + [7],
            torch.randint(0, VOCAB, (10,), generator=g).tolist()]


def _reference(hf):
    out = []
    with torch.no_grad():
        for p in _prompts():
            ids = torch.tensor([p])
            tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=STEPS,
                                 min_new_tokens=STEPS)[0, len(p):].tolist()
            logits = hf(torch.tensor([p + tokens])).logits[0, len(p) - 1: -1]
            out.append((tokens, torch.log_softmax(logits.double(), -1)))
    return out


def _run(eng, windows):
    """Every prompt at once, stepping the engine and checking each decoding sequence's blocks per group."""
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    for i, p in enumerate(_prompts()):
        eng.add_request(str(i), p, params)
    bm, done, most = eng.block_manager, {}, [0] * len(windows)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
        for seq in eng.scheduler.running:
            if seq.num_computed_tokens <= len(seq.prompt_token_ids):
                continue  # decoding only
            live = bm.live_blocks(seq)
            for g, w in enumerate(windows):
                if w is None:
                    assert len(live[g]) == -(-seq.num_computed_tokens // BS) or \
                        len(live[g]) == -(-(seq.num_computed_tokens + 1) // BS)  # the next token's block taken
                else:
                    assert len(live[g]) <= -(-w // BS) + 1, (g, len(live[g]))
                most[g] = max(most[g], len(live[g]))
    return [done[str(i)] for i in range(len(_prompts()))], most


PAGE = BS * 2 * 2 * 16 * 4  # one block of one layer: tokens x (k, v) x kv heads x head dim x float32


@pytest.mark.parametrize("kind, mode, pages", [("gemma3", "recompute", 48), ("gpt_oss", "swap", 28)])
def test_group_tables_far_past_the_window_match_hf(kind, mode, pages, tmp_path):
    hf = _model(kind, tmp_path)
    reference = _reference(hf)
    # the pool: 3 sequences decoding up to 49 tokens hold 3 x (13 + 3 per sliding group) pages; fewer force preemption
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=8, max_num_seqs=3,
              enable_prefix_caching=True, kv_cache_memory=pages * PAGE, preemption_mode=mode,
              swap_space=0.01 if mode == "swap" else 0)
    try:
        eng = llm.engine
        windows = [g.window for g in eng.runner.cache_layout.table_groups]
        assert windows[0] is None and len(windows) == (6 if kind == "gemma3" else 2)
        preempted = 0
        for round_ in range(2):  # the second round starts from the first's cached blocks
            outs, most = _run(eng, windows)
            for out, (tokens, ref_lp) in zip(outs, reference):
                assert out.token_ids == tokens, round_
                assert len(set(tokens)) > STEPS // 6  # a varied continuation, so equal tokens say something
                for i, lp in enumerate(out.logprobs):
                    for tok, entry in lp.items():
                        assert abs(entry.logprob - float(ref_lp[i, tok])) < 1e-4, (round_, i, tok)
            assert eng.block_manager.num_free_blocks == eng.block_manager.capacity  # every block back
            assert max(most[1:]) == -(-windows[1] // BS) + 1 and most[0] > 2 * most[1]
        s = eng.scheduler
        preempted = s.num_preemptions
        assert preempted > 0 and (mode != "swap" or s.num_swap_preemptions > 0)
        assert s.num_prefix_cached_tokens >= 2 * 8
        assert eng.block_manager.num_window_released > 0
    finally:
        llm.engine.executor.shutdown()


def test_group_tables_tp2_equals_one_process(tmp_path):
    """Tensor parallelism on gloo (a process per extra rank: the step codec carries each group's slot mapping
    and tables to the other rank): the tiny Gemma 3 gives one process's tokens and logprobs, and HF's."""
    hf = _model("gemma3", tmp_path)
    reference = _reference(hf)
    got = {}
    for tp in (1, 2):  # per rank: its kv heads, so half the bytes for the same pages
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=8,
                  max_num_seqs=3, enable_prefix_caching=True, kv_cache_memory=48 * PAGE // tp, tensor_parallel_size=tp)
        try:
            windows = [g.window for g in llm.engine.runner.cache_layout.table_groups]
            got[tp], _ = _run(llm.engine, windows)
            assert llm.engine.scheduler.num_preemptions > 0
        finally:
            llm.engine.executor.shutdown()
    for one, two, (tokens, ref_lp) in zip(got[1], got[2], reference):
        assert one.token_ids == two.token_ids == tokens
        for i, (a, b) in enumerate(zip(one.logprobs, two.logprobs)):
            assert a.keys() == b.keys()
            for tok in a:
                assert abs(a[tok].logprob - b[tok].logprob) < 1e-4
                assert abs(b[tok].logprob - float(ref_lp[i, tok])) < 1e-4
