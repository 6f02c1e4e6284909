"""KV tiers on the embedded SmolLM2 (CPU by default): a preemption-heavy load with recompute vs swap
(throughput), and repeated long prefixes with and without the host prefix tier (TTFT of the repeats).

    python benchmarks/kv_tiers.py [--device cpu] [--json out.json]

Prints a table and the JSON (numbers belong in docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import time

from turnout.engine.llm import LLM
from turnout.engine.sampling_params import SamplingParams


def preemption(mode: str, args) -> dict:
    llm = LLM(device=args.device, kv_cache_memory=args.kv_blocks * 737280, preemption_mode=mode, max_num_seqs=16,
              swap_space=0.25)
    prompts = [f"Tell me about the number {i} in three sentences." for i in range(args.seqs)]
    p = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, p, use_tqdm=False)
    dt = time.perf_counter() - t0
    s = llm.engine.get_stats()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"mode": mode, "seconds": dt, "output_tokens": n, "tokens_per_s": n / dt,
            "preemptions": s.num_preemptions_total, "swap_preemptions": s.swap_preemptions_total,
            "swapped_out_blocks": s.swapped_out_blocks_total, "prefill_tokens": llm.engine.scheduler.num_prefill_tokens_computed,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def host_tier(gb: float, args) -> dict:
    llm = LLM(device=args.device, kv_cache_memory=args.kv_blocks * 737280, kv_offload_gb=gb, max_num_seqs=16,
              preemption_mode="recompute")
    system = "You are a helpful assistant who answers in full sentences. " * 10
    p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ttft = []
    for turn in range(args.turns):
        llm.generate(system + f"Question {turn}: name a colour.", p, use_tqdm=False)  # the shared prefix
        for i in range(2):  # unrelated prompts evict it from the device
            llm.generate(f"Unrelated filler text {turn}.{i}. " * 12, p, use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate(system + f"Follow-up {turn}: and another?", p, use_tqdm=False)
        ttft.append(time.perf_counter() - t0)
    s = llm.engine.get_stats()
    ttft.sort()
    return {"kv_offload_gb": gb, "ttft_p50_s": ttft[len(ttft) // 2], "ttft_max_s": ttft[-1],
            "host_hit_tokens": s.host_tier_hit_tokens_total, "prefix_hit_tokens": s.prefix_cache_hit_tokens_total}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-blocks", type=int, default=12)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pre = [preemption(m, args) for m in ("recompute", "swap")]
    same = pre[0].pop("tokens") == pre[1].pop("tokens")
    tier = [host_tier(gb, args) for gb in (0.0, 0.05)]
    result = {"device": args.device, "preemption": pre, "identical_tokens": same, "host_tier": tier}
    print(f"{'preemption':<12}{'tok/s':>8}{'s':>8}{'preempt':>9}{'swapped':>9}{'prefill tok':>12}")
    for r in pre:
        print(f"{r['mode']:<12}{r['tokens_per_s']:>8.1f}{r['seconds']:>8.2f}{r['preemptions']:>9}"
              f"{r['swapped_out_blocks']:>9}{r['prefill_tokens']:>12}")
    print(f"identical tokens: {same}")
    print(f"{'host tier GB':<14}{'TTFT p50 ms':>12}{'max ms':>9}{'host hit tok':>13}")
    for r in tier:
        print(f"{r['kv_offload_gb']:<14}{r['ttft_p50_s'] * 1e3:>12.1f}{r['ttft_max_s'] * 1e3:>9.1f}{r['host_hit_tokens']:>13}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
