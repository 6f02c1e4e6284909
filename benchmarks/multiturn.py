"""KV tiers under a multi-turn chat load, through the Python API (LLMEngine add_request / step).

Multi-turn: N conversations x T turns, a shared system prompt and growing history (turn t's prompt is the
system prompt, every earlier user message and answer, and a new user message); turn t+1 of a conversation
arrives when its turn t finishes (so N run at once, a closed load that saturates the engine: TTFT is then
mostly queueing), or ``--think-time`` seconds later on average with conversations ``--conv-interval`` apart
(an open load: TTFT is the prefill, or the host tier's load, of a history evicted while its user thought). Device KV holds ``--kv-fraction`` of the conversations'
full KV (sized from the workload); the same load runs with the host prefix tier off and on (sized to hold
every conversation). Reported: TTFT p50 / p99 of turn 1 and of turns 2..T (per request: add_request to
its first token), output tokens/s, host-tier hit tokens, and the KV tier counters (turnout/kv/stats.py).
Preemption storm: ``--storm-seqs`` long sequences with KV for ``--storm-fit`` of them, recompute vs swap:
throughput, prefill tokens recomputed, identical greedy tokens. Overlap: the per-layer async swap-in's
share hidden behind a forward (KVTransfer.measure_overlap, device events; "n/a" on CPU).

    python benchmarks/multiturn.py                 # H200 defaults: dummy Qwen3-8B bf16, 200 x 5, storm 512 / 128
    python benchmarks/multiturn.py --small         # embedded SmolLM2 on CPU, a couple of minutes
    python benchmarks/multiturn.py --json out.json

Prints a table, then one JSON line (numbers belong in docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import random
import time

from turnout.engine.llm import LLM
from turnout.engine.sampling_params import SamplingParams
from turnout.entrypoints.bench_models import resolve_model
from turnout.kv.stats import format_tiers, tier_report
from turnout.loader import _load_config
from turnout.loader.source import resolve_source

BIG = dict(model="qwen3-8b", dtype="bfloat16", device="cuda", convs=200, turns=5, system=1024, user=128, answer=128,
           storm_seqs=512, storm_fit=128, storm_prompt=1024, storm_output=256)
SMALL = dict(model=None, dtype="float32", device="cpu", convs=4, turns=3, system=64, user=16, answer=8,
             storm_seqs=6, storm_fit=2, storm_prompt=32, storm_output=16)


def block_bytes(path, dtype: str, block_size: int) -> int:
    """A KV block's bytes (k and v, every layer) from the model's config, before the engine exists."""
    cfg = _load_config(resolve_source(path, config_only=True))
    cfg = getattr(cfg, "text_config", cfg)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    elem = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    return 2 * cfg.num_hidden_layers * block_size * kv * head_dim * elem


def _pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else None


def make_llm(args, num_blocks: int, **kw) -> LLM:
    llm = LLM(model=args.path, load_format=args.load_format, dtype=args.dtype, device=args.device,
              kv_cache_memory=num_blocks * args.block_bytes, block_size=args.block_size, **kw)
    assert llm.engine.runner.block_bytes == args.block_bytes, "block size computed from the config is off"
    return llm


def multiturn(args, offload_gb: float) -> dict:
    rng = random.Random(args.seed)
    vocab_hi = args.vocab - 10
    tok = lambda n: [rng.randrange(10, vocab_hi) for _ in range(n)]  # noqa: E731
    system = tok(args.system)
    users = [[tok(args.user) for _ in range(args.turns)] for _ in range(args.convs)]
    llm = make_llm(args, args.mt_blocks, kv_offload_gb=offload_gb, max_num_seqs=args.convs,
                   preemption_mode=args.preemption_mode, max_model_len=args.final_len + 8)
    eng = llm.engine
    overlap = eng.runner.kv_transfer.measure_overlap() if offload_gb else None  # before any block is owned
    eng.add_request("warm", tok(args.system), SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    eng.reset_prefix_cache()
    params = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)
    history = [list(system) for _ in range(args.convs)]
    added, ttft = {}, {}
    before = eng.get_stats()

    def add(c: int, t: int) -> None:
        history[c] += users[c][t]
        rid = f"c{c}-t{t}"
        added[rid] = time.perf_counter()
        eng.add_request(rid, list(history[c]), params)

    t0 = time.perf_counter()
    due: list[tuple[float, int, int]] = []  # (when, conversation, turn) not added yet, a heap
    for c in range(args.convs):
        heapq.heappush(due, (t0 + c * args.conv_interval, c, 0))
    gen = 0
    while due or eng.has_unfinished_requests():
        now = time.perf_counter()
        while due and due[0][0] <= now:
            _, c, t = heapq.heappop(due)
            add(c, t)
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, due[0][0] - now))
            continue
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in ttft and o.outputs[0].token_ids:
                ttft[o.request_id] = now - added[o.request_id]
            if o.finished:
                c, t = (int(x[1:]) for x in o.request_id.split("-"))
                history[c] += list(o.outputs[0].token_ids)
                gen += len(o.outputs[0].token_ids)
                if t + 1 < args.turns:  # the user reads the answer and types the next message
                    think = rng.expovariate(1.0 / args.think_time) if args.think_time > 0 else 0.0
                    heapq.heappush(due, (now + think, c, t + 1))
    wall = time.perf_counter() - t0
    first = [v for k, v in ttft.items() if k.endswith("-t0")]
    later = [v for k, v in ttft.items() if not k.endswith("-t0")]
    s = eng.get_stats()
    r = {"kv_offload_gb": offload_gb, "seconds": wall, "output_tok_s": gen / wall, "requests": len(ttft),
         "ttft_turn1_p50_s": _pct(first, 0.5), "ttft_turn1_p99_s": _pct(first, 0.99),
         "ttft_later_p50_s": _pct(later, 0.5), "ttft_later_p99_s": _pct(later, 0.99),
         "prefix_hit_tokens": s.prefix_cache_hit_tokens_total - before.prefix_cache_hit_tokens_total,
         "preemptions": s.num_preemptions_total - before.num_preemptions_total,
         "kv_tiers": tier_report(s, before, eng.runner.kv_transfer)}
    if overlap is not None:
        r["overlap"] = overlap
    llm = eng = None  # the engine freed before the next run (not del: the closure add names eng)
    gc.collect()
    return r


def storm(args, mode: str) -> dict:
    rng = random.Random(args.seed + 1)
    prompts = [[rng.randrange(10, args.vocab - 10) for _ in range(args.storm_prompt)] for _ in range(args.storm_seqs)]
    llm = make_llm(args, args.storm_blocks, preemption_mode=mode, max_num_seqs=args.storm_seqs,
                   swap_space=args.storm_swap_gb, max_model_len=args.storm_prompt + args.storm_output + 8,
                   batch_invariant=args.batch_invariant)
    eng = llm.engine
    llm.generate(prompts[0][:16], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    before = eng.get_stats()
    rec0 = eng.scheduler.num_prefill_tokens_computed
    p = SamplingParams(max_tokens=args.storm_output, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, p, use_tqdm=False)
    wall = time.perf_counter() - t0
    s = eng.get_stats()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    r = {"mode": mode, "seconds": wall, "output_tok_s": n / wall, "output_tokens": n,
         "preemptions": s.num_preemptions_total - before.num_preemptions_total,
         "prefill_tokens": eng.scheduler.num_prefill_tokens_computed - rec0,
         "kv_tiers": tier_report(s, before, eng.runner.kv_transfer), "tokens": [o.outputs[0].token_ids for o in outs]}
    del llm, eng, outs
    gc.collect()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="embedded SmolLM2 on CPU, small sizes")
    for k, v in BIG.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v) if v is not None else str, default=None)
    ap.add_argument("--kv-fraction", type=float, default=0.2)
    ap.add_argument("--preemption-mode", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-host-gb", type=float, default=48.0, help="cap on the host tier and the swap pool, each")
    ap.add_argument("--think-time", type=float, default=0.0,
                    help="mean seconds (exponential) between a turn's answer and the next message; 0: at once")
    ap.add_argument("--conv-interval", type=float, default=0.0,
                    help="seconds between conversation starts; 0: all at once (a closed, saturating load)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the storm in batch-invariant mode: its two runs batch (and recompute) differently, so "
                         "on bf16 random weights, whose argmax margins are below rounding, only then can greedy "
                         "tokens compare equal")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: multiturn, storm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for k, v in (SMALL if args.small else BIG).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.path, bundled = resolve_model(args.model)
    args.load_format = "dummy" if bundled else "auto"
    args.block_bytes = block_bytes(args.path, args.dtype, args.block_size)
    cfg = _load_config(resolve_source(args.path, config_only=True))
    args.vocab = getattr(cfg, "text_config", cfg).vocab_size
    bs, gib = args.block_size, 2**30
    args.final_len = args.system + args.turns * (args.user + args.answer)
    per_conv = -(-args.final_len // bs)
    args.mt_blocks = max(int(args.kv_fraction * args.convs * per_conv), per_conv + 2)
    unique = -(-args.system // bs) + args.convs * -(-(args.final_len - args.system) // bs) + args.convs
    offload_gb = min(args.max_host_gb, 1.1 * unique * args.block_bytes / gib)
    per_seq = -(-(args.storm_prompt + args.storm_output) // bs)
    args.storm_blocks = args.storm_fit * per_seq
    args.storm_swap_gb = min(args.max_host_gb, 1.1 * (args.storm_seqs - args.storm_fit) * per_seq * args.block_bytes / gib)
    skip = set(filter(None, args.skip.split(",")))
    result = {"model": args.model or "SmolLM2-135M (embedded)", "dtype": args.dtype, "device": args.device,
              "convs": args.convs, "turns": args.turns, "system": args.system, "user": args.user, "answer": args.answer,
              "kv_fraction": args.kv_fraction, "device_blocks": args.mt_blocks, "block_bytes": args.block_bytes,
              "think_time_s": args.think_time, "conv_interval_s": args.conv_interval}
    if "multiturn" not in skip:
        result["multiturn"] = [multiturn(args, gb) for gb in (0.0, offload_gb)]
        off, on = result["multiturn"]
        result["turn2_ttft_p50_speedup"] = (off["ttft_later_p50_s"] / on["ttft_later_p50_s"]
                                            if on["ttft_later_p50_s"] else None)
        print(f"multi-turn: {args.convs} conversations x {args.turns} turns, system {args.system}, user {args.user}, "
              f"answer {args.answer} tokens; device KV {args.mt_blocks} blocks ({args.kv_fraction:g} of the load); "
              f"conversations {args.conv_interval:g} s apart, think time {args.think_time:g} s")
        print(f"{'host tier GiB':<14}{'turn1 p50':>10}{'p99':>9}{'turn2+ p50':>11}{'p99':>9}{'out tok/s':>10}"
              f"{'host hit tok':>13}{'preempt':>8}")
        for r in result["multiturn"]:
            ms = lambda x: f"{x * 1e3:.0f}ms" if x is not None else "-"  # noqa: E731
            print(f"{r['kv_offload_gb']:<14.2f}{ms(r['ttft_turn1_p50_s']):>10}{ms(r['ttft_turn1_p99_s']):>9}"
                  f"{ms(r['ttft_later_p50_s']):>11}{ms(r['ttft_later_p99_s']):>9}{r['output_tok_s']:>10.1f}"
                  f"{r['kv_tiers']['host_tier_hit_tokens_total']:>13}{r['preemptions']:>8}")
            print(f"  {format_tiers(r['kv_tiers'])}")
        ov = on.get("overlap", {})
        result["overlap"] = ov
        print("async swap-in hidden behind the forward: " + (f"{ov['hidden']:.1%} (copy {ov['copy_ms']:.2f} ms of "
              f"{ov['blocks']} blocks, forward {ov['forward_ms']:.2f} ms alone, {ov['forward_with_swap_in_ms']:.2f} "
              f"ms with it)" if ov.get("hidden") is not None else ov.get("why", "n/a")))
    if "storm" not in skip:
        result["storm"] = [storm(args, m) for m in ("recompute", "swap")]
        result["storm_identical_tokens"] = result["storm"][0].pop("tokens") == result["storm"][1].pop("tokens")
        print(f"storm: {args.storm_seqs} sequences of {args.storm_prompt} + {args.storm_output} tokens, KV for "
              f"{args.storm_fit} ({args.storm_blocks} blocks)")
        print(f"{'mode':<11}{'out tok/s':>10}{'s':>8}{'preempt':>9}{'swapped out':>12}{'pool full':>10}{'prefill tok':>12}")
        for r in result["storm"]:
            t = r["kv_tiers"]
            print(f"{r['mode']:<11}{r['output_tok_s']:>10.1f}{r['seconds']:>8.2f}{r['preemptions']:>9}"
                  f"{t['swapped_out_blocks_total']:>12}{t['swap_pool_full_total']:>10}{r['prefill_tokens']:>12}")
        print(f"identical tokens: {result['storm_identical_tokens']}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
