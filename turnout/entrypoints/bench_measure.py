"""The offline benchmarks' measurement: drive the engine step by step, time every step, and turn the
steps into the latency or throughput figures (tokens/s, achieved GB/s and TFLOP/s from the model's
geometry). Apart from bench_cmd.py, which parses the flags, builds the engine and assembles the result,
because this is the part that defines what a number means.
"""

from __future__ import annotations

import math
import statistics
import time

from turnout.entrypoints.bench_models import random_prompts
from turnout.kv.stats import tier_report


class _Step:
    __slots__ = ("dt", "prompt_tokens", "gen_tokens")

    def __init__(self, dt, prompt_tokens, gen_tokens):
        self.dt, self.prompt_tokens, self.gen_tokens = dt, prompt_tokens, gen_tokens

    @property
    def is_prefill(self) -> bool:
        return self.prompt_tokens > 0


def run_to_completion(engine, prompts, params, tag: str) -> tuple[list[_Step], float]:
    """Add every prompt, step until all finish; time each step (a step ends in the sampled tokens'
    device->host copy, so its wall time is its GPU time plus host work)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    steps: list[_Step] = []
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        before = engine.get_stats()
        t0 = time.perf_counter()
        engine.step(finished_only=True)  # as LLM.generate: results only at the end
        dt = time.perf_counter() - t0
        after = engine.get_stats()
        steps.append(_Step(dt, after.prompt_tokens_total - before.prompt_tokens_total,
                           after.generation_tokens_total - before.generation_tokens_total))
    return steps, time.perf_counter() - t_start


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _div(a, b):
    return a / b if b else None


# ---- the two benchmarks --------------------------------------------------------------------------
def bench_latency(args, llm, geo) -> dict:
    from turnout.engine.sampling_params import SamplingParams
    from turnout.utils.roofline import prefill_attn_pairs

    eng = llm.engine
    vocab = eng.runner.vocab_size
    B, L, O = args.batch_size, args.input_len, args.output_len
    for w in range(args.num_iters_warmup):
        run_to_completion(eng, random_prompts(B, L, vocab, args.seed + 1000 + w),
                          SamplingParams(max_tokens=min(O, 8), temperature=0.0, ignore_eos=True), f"warmup{w}")
    params = SamplingParams(max_tokens=O, temperature=0.0, ignore_eos=True)
    before = eng.get_stats()
    latencies, prefills, decode_steps, decode_times = [], [], [], []
    decode_bytes = decode_flops = 0.0
    for it in range(args.num_iters):
        steps, total = run_to_completion(eng, random_prompts(B, L, vocab, args.seed + it), params, f"it{it}")
        latencies.append(total)
        prefills.append(sum(s.dt for s in steps if s.is_prefill))
        dsteps = [s for s in steps if not s.is_prefill]
        decode_steps += [s.dt for s in dsteps]
        decode_times.append(sum(s.dt for s in dsteps))
        for k, s in enumerate(dsteps, start=1):  # decode step k attends to L + k tokens per sequence
            n = s.gen_tokens or B
            decode_bytes += geo.weight_bytes_per_step(n) + n * (L + k + 1) * geo.kv_bytes_per_token
            decode_flops += geo.flops(n, n, n * (L + k))
    iters = args.num_iters
    decode_time = sum(decode_times)
    prefill_mean = statistics.fmean(prefills)
    prefill_flops = geo.flops(B * L, B, B * prefill_attn_pairs(L))
    step_mean = statistics.fmean(decode_steps) if decode_steps else None
    r = {"batch_size": B, "num_iters": iters, "latency_s": statistics.fmean(latencies),
         "latency_p50_s": _pct(latencies, 0.5), "latency_p90_s": _pct(latencies, 0.9), "latencies_s": latencies,
         "prefill_s": prefill_mean, "prefill_tok_s": _div(B * L, prefill_mean),
         "prefill_TFLOP_s": _div(prefill_flops / 1e12, prefill_mean),
         "decode_step_ms": step_mean * 1e3 if step_mean else None,
         "decode_step_p50_ms": (_pct(decode_steps, 0.5) or 0) * 1e3 if decode_steps else None,
         "decode_step_p90_ms": (_pct(decode_steps, 0.9) or 0) * 1e3 if decode_steps else None,
         "decode_tok_s": _div(B, step_mean), "decode_GB_s": _div(decode_bytes / 1e9, decode_time),
         "decode_TFLOP_s": _div(decode_flops / 1e12, decode_time),
         "output_tok_s": _div(B * O, statistics.fmean(latencies)),
         "kv_tiers": tier_report(eng.get_stats(), before, eng.runner.kv_transfer)}
    r["achieved_GB_s"], r["achieved_TFLOP_s"] = r["decode_GB_s"], r["decode_TFLOP_s"]
    return r


def bench_throughput(args, llm, geo) -> dict:
    from turnout.engine.sampling_params import SamplingParams
    from turnout.utils.roofline import decode_attn_pairs, prefill_attn_pairs

    eng = llm.engine
    vocab = eng.runner.vocab_size
    N, L, O = args.num_prompts, args.input_len, args.output_len
    warm = min(N, 8)  # compiles the prefill and decode kernels before the clock starts
    run_to_completion(eng, random_prompts(warm, L, vocab, args.seed + 1000),
                      SamplingParams(max_tokens=min(O, 4), temperature=0.0, ignore_eos=True), "warmup")
    before = eng.get_stats()
    steps, elapsed = run_to_completion(eng, random_prompts(N, L, vocab, args.seed),
                                       SamplingParams(max_tokens=O, temperature=0.0, ignore_eos=True), "req")
    gen = sum(s.gen_tokens for s in steps)
    dsteps = [s for s in steps if not s.is_prefill]
    weight_bytes = sum(geo.weight_bytes_per_step(s.prompt_tokens + s.gen_tokens) for s in steps)
    kv_tokens = N * (decode_attn_pairs(L, O) + L + (L + O))  # decode reads + prefill reads + writes
    total_bytes = weight_bytes + kv_tokens * geo.kv_bytes_per_token
    flops = geo.flops(N * (L + O - 1), N * O, N * (prefill_attn_pairs(L) + decode_attn_pairs(L, O)))
    dtime = sum(s.dt for s in dsteps)
    r = {"num_prompts": N, "elapsed_s": elapsed, "requests_per_s": N / elapsed, "output_tok_s": gen / elapsed,
         "total_tok_s": (N * L + gen) / elapsed, "num_steps": len(steps),
         "num_prefill_steps": len(steps) - len(dsteps), "num_decode_steps": len(dsteps),
         "prefill_steps_s": sum(s.dt for s in steps if s.is_prefill), "decode_steps_s": dtime,
         "decode_step_ms": _div(dtime * 1e3, len(dsteps)),
         "mean_decode_batch": _div(sum(s.gen_tokens for s in dsteps), len(dsteps)),
         "num_preemptions": eng.get_stats().num_preemptions_total - before.num_preemptions_total,
         "kv_tiers": tier_report(eng.get_stats(), before, eng.runner.kv_transfer),
         "achieved_GB_s": total_bytes / 1e9 / elapsed, "achieved_TFLOP_s": flops / 1e12 / elapsed}
    return r
