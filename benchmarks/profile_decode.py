"""Where a decode step's GPU time goes: torch.profiler over N engine steps (dummy weights).

    python benchmarks/profile_decode.py [--model qwen3-8b] [--batch 1] [--steps 32] [--enforce-eager]
        [--quantization fp8] [--kv-cache-dtype fp8]
Prints the top CUDA kernels by total time and the share of the step each takes.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    from turnout import LLM, SamplingParams
    from turnout.entrypoints.bench_models import resolve_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: input-len + all steps + 16")
    ap.add_argument("--quantization", default=None, help="e.g. fp8 (online quantisation of the dummy weights)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also cProfile the host over the wall-time steps and print its top N functions (the GPU "
                         "waits for the host when wall time exceeds GPU busy time)")
    args = ap.parse_args()
    # Sequences that finish their prefill decode while the others' chunks run, so the prefill takes more steps
    # than batch * input_len / 2048 (137 against 128 at 256 x 1024): warm up until every sequence decodes (timing
    # from a fixed step counted prefill steps into decode at batch 256), then 4 steps more.
    prefill_steps = 2 * (args.batch * args.input_len) // 2048 + args.batch + 8  # an upper bound
    max_tokens = prefill_steps + 4 + 3 * args.steps + 8  # warm, wall, host profile, torch profiler
    llm = LLM(resolve_model(args.model)[0], load_format="dummy", dtype="bfloat16",
              max_model_len=args.max_model_len or args.input_len + max_tokens + 16, max_num_seqs=max(args.batch, 1), enforce_eager=args.enforce_eager, gpu_memory_utilization=0.5,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(str(i), torch.randint(0, 1000, (args.input_len,), generator=g).tolist(), p)
    sched = eng.core.scheduler
    for n in range(prefill_steps):  # noqa: B007 - read after the loop: the steps the prefill took
        eng.step()
        if (not sched.waiting and len(sched.running) == args.batch
                and all(seq.num_computed_tokens >= args.input_len for seq in sched.running)):
            break
    else:
        raise SystemExit(f"the prefill did not finish in {prefill_steps} steps")
    print(f"prefill done after {n + 1} steps", flush=True)
    for _ in range(4):
        eng.step()
    torch.cuda.synchronize()
    import time

    t0 = time.perf_counter()
    for _ in range(args.steps):  # wall time per step, no profiler
        eng.step(finished_only=True)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / args.steps * 1e3
    if args.host_profile:
        import cProfile
        import pstats

        host = cProfile.Profile()
        t1 = time.perf_counter()
        host.enable()
        for _ in range(args.steps):
            eng.step(finished_only=True)
        torch.cuda.synchronize()
        host.disable()
        print(f"host profile: {(time.perf_counter() - t1) / args.steps * 1e3:.3f} ms a step under cProfile, "
              f"lookahead steps so far {eng.core.num_lookahead_steps}")
        for key in ("tottime", "cumulative"):
            pstats.Stats(host).sort_stats(key).print_stats(args.host_profile)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    print(table)
    # GPU busy time per step: the kernels' own time (a graph replay's kernels are listed one by one)
    busy_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / args.steps
    if busy_ms > wall_ms:  # kernels overlap: with PDL a kernel's time includes its wait for the one before
        print(f"per step: wall {wall_ms:.3f} ms (no profiler), summed kernel time {busy_ms:.3f} ms: kernels "
              f"overlap (programmatic dependent launch), so per-kernel times include waiting; "
              f"TURNOUT_PDL=0 for times without overlap")
        return
    print(f"per step: wall {wall_ms:.3f} ms (no profiler), GPU busy {busy_ms:.3f} ms, "
          f"idle {wall_ms - busy_ms:.3f} ms ({100 * (wall_ms - busy_ms) / wall_ms:.0f}%: host work the GPU waits "
          f"for, plus the gaps between kernels)")


if __name__ == "__main__":
    main()
