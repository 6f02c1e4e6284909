"""Tensor parallelism against one rank on the same machine (its correctness check; NCCL on GPUs).

    python benchmarks/tp_check.py --tp 2 --json out.json               # GPU: tiny random fp32 models + Qwen3-8B dummy bf16
    python benchmarks/tp_check.py --tp 2 --device cpu --skip-large      # SMOKE on CPU over gloo

1. Tiny random HF checkpoints (Llama with one kv head: replicated heads; Qwen3; Qwen3-MoE, also with expert
   parallelism) in float32: 32 greedy tokens identical and per-token logprobs within 1e-5 (absolute).
2. Qwen3-8B dummy bf16 (dummy weights are drawn at full shape, so both runs hold the same model): greedy
   tokens of 4 prompts and the largest logprob difference (bf16 tolerance: reported, and the first token of
   each prompt must agree).
Rank 0's table and one JSON line (benchmarks/common.py: report).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))


def _tiny(family: str, path: str) -> str:
    import torch
    import transformers

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=32,
                  num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, num_key_value_heads=1)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common, num_key_value_heads=2)
    else:
        cfg = transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=64, norm_topk_prob=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def _run(model, prompts, params, **kw):
    from turnout import LLM

    llm = LLM(model, seed=0, **kw)
    outs = llm.generate_tokens(prompts, params)
    res = [(o.token_ids, o.logprobs) for o in outs]
    shutdown = getattr(llm.engine.executor, "shutdown", None)
    if shutdown is not None:  # the worker processes and this process's group go now, before the next engine
        shutdown()
    del llm, outs
    gc.collect()
    return res


def _compare(a, b) -> dict:
    same = [x[0] == y[0] for x, y in zip(a, b)]
    n = [min(len(x[1]), len(y[1])) for x, y in zip(a, b)]
    d = max((abs(p - q) for x, y, k in zip(a, b, n) for p, q in zip(x[1][:k], y[1][:k])), default=0.0)
    first = all(x[0][:1] == y[0][:1] for x, y in zip(a, b))
    return {"greedy_identical": all(same), "first_tokens_identical": first, "max_logprob_diff": d}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--large", default="qwen3-8b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from turnout import SamplingParams
    from turnout.entrypoints.bench_models import resolve_model

    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 11 * i)] for i in range(4)]
    rows = []
    kw = dict(dtype="float32", device=args.device, kv_cache_memory=64 << 20)
    with tempfile.TemporaryDirectory() as tmp:
        for family, ep in (("llama", False), ("qwen3", False), ("qwen3_moe", False), ("qwen3_moe", True)):
            path = os.path.join(tmp, family)
            if not os.path.exists(path):
                _tiny(family, path)
            one = _run(path, prompts, greedy, **kw)
            many = _run(path, prompts, greedy, tensor_parallel_size=args.tp, enable_expert_parallel=ep, **kw)
            r = {"model": family + (" EP" if ep else ""), "dtype": "float32", **_compare(one, many)}
            r["ok"] = r["greedy_identical"] and r["max_logprob_diff"] <= 1e-5
            rows.append(r)
    if not args.skip_large:
        big = resolve_model(args.large)[0]
        lp = [[(13 * i + 7 * j) % 5000 + 10 for j in range(20 + 9 * i)] for i in range(4)]
        kwb = dict(load_format="dummy", dtype="bfloat16", device=args.device, max_model_len=1024,
                   gpu_memory_utilization=0.5)
        one = _run(big, lp, greedy, **kwb)
        many = _run(big, lp, greedy, tensor_parallel_size=args.tp, **kwb)
        r = {"model": args.large, "dtype": "bfloat16", **_compare(one, many)}
        r["ok"] = r["first_tokens_identical"]
        rows.append(r)
    from common import report

    report(f"TP={args.tp} against TP=1", rows, ["model", "dtype", "greedy_identical", "first_tokens_identical",
                                                "max_logprob_diff", "ok"], {"tp": args.tp})
    if args.json:
        json.dump(rows, open(args.json, "w"))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
