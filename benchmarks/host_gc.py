"""What Python's cyclic garbage collector costs a big-batch step, with and without the start-up heap frozen
(turnout/utils/gc_freeze.py, which `turnout serve` and `turnout bench` apply).

A tiny random Qwen3 (so the forward is small beside the host work) on the CPU, 256 sequences decoding at
once (32-token prompts, async scheduling off so each step is timed whole): the mean and the longest step
over --steps steps (a full collection is a pause of one step), the collector's time in them (gc.callbacks) and the number of full (generation 2) collections; each
mode in its own process, one after the other.

    PYTHONPATH=$PWD python benchmarks/host_gc.py [--seqs 256] [--steps 300]

Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, report  # noqa: E402


def one(mode: str, seqs: int, steps: int) -> dict:
    import gc
    import random

    import torch
    import transformers

    from turnout import LLM, SamplingParams
    from turnout.utils.gc_freeze import freeze_startup_heap

    torch.set_num_threads(1)
    d = tempfile.mkdtemp()
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=2048)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    llm = LLM(d, dtype="float32", kv_cache_memory=256 << 20, max_num_seqs=seqs, max_num_batched_tokens=8192,
              enable_prefix_caching=False, async_scheduling=False)
    frozen = freeze_startup_heap() if mode == "frozen" else 0
    eng = llm.engine
    spent, full, t_start = [0.0], [0], [0.0]

    def on_gc(phase, info):
        if phase == "start":
            t_start[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - t_start[0]
            full[0] += info["generation"] == 2
    rng = random.Random(0)
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    for i in range(seqs):
        eng.add_request(str(i), [rng.randrange(10, 500) for _ in range(32)], sp)
    for _ in range(5):  # the prefill and the first decode steps
        eng.step()
    gc.callbacks.append(on_gc)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    gc.callbacks.remove(on_gc)
    return {"mode": mode, "step_ms": sum(times) / steps * 1e3, "max_step_ms": max(times) * 1e3,
            "gc_ms_per_step": spent[0] / steps * 1e3, "full_collections": full[0], "frozen_objects": frozen,
            "tracked_objects": len(gc.get_objects())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.seqs, args.steps)))
        return 0
    rows = []
    for mode in ("collector as is", "frozen"):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", mode, "--seqs", str(args.seqs),
                            "--steps", str(args.steps)], capture_output=True, text=True)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if r.returncode or line is None:
            sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
            return 1
        rows.append(json.loads(line[7:]))
    report(f"host GC cost of a {args.seqs}-sequence decode step (tiny Qwen3, CPU)", rows,
           ["mode", "step_ms", "max_step_ms", "gc_ms_per_step", "full_collections", "frozen_objects", "tracked_objects"],
           {"machine": machine(), "seqs": args.seqs, "steps": args.steps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
