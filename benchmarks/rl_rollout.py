"""The RL rollout numbers on a GPU: memory handed back by sleep(1), wake_up time, and a full weight
update from another process by CUDA IPC buckets.

One engine (dummy weights) per model. Measured, in this order:

1. ``sleep(level=1)``: device memory in use (cudaMemGetInfo, so what torch's cache still holds counts as used)
   before and after, against what torch held for the engine (memory_reserved); the target is >= 95 % freed.
2. ``wake_up()``: seconds (weights back from pinned host memory, the KV cache re-allocated, decode graphs
   re-captured), and greedy tokens before sleeping == after waking.
3. A trainer process on the same GPU builds every checkpoint tensor of the model (HF names and shapes from
   ``transformers`` on the meta device, random values), packs them into buckets of ``--bucket-mb``
   (turnout/worker/weight_ipc.py ``make_bucket``) and sends each handle; the engine applies each with
   ``update_weights_from_ipc``. Reported: the wall time from the first bucket sent to the last applied
   (the trainer's packing included, as verl's figures are), the engine's share, GB and GB/s; then greedy
   tokens after the update differ from before (the new weights are in use).

JSON lines + a table (benchmarks/common.py: report). GPU only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import time

from common import report


def _trainer(model_dir: str, dtype: str, bucket_mb: int, conn) -> None:
    import torch
    import transformers

    from turnout.worker.weight_ipc import make_bucket

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(1234)
    named = []
    for name, p in meta.state_dict().items():
        if getattr(config, "tie_word_embeddings", False) and name == "lm_head.weight":
            continue
        named.append((name, tuple(p.shape)))
    conn.send(sum(torch.Size(s).numel() for _, s in named) * dt.itemsize)
    limit = bucket_mb << 20
    t0 = time.perf_counter()
    i = 0
    while i < len(named):
        part, size = [], 0
        while i < len(named) and (not part or size + torch.Size(named[i][1]).numel() * dt.itemsize <= limit):
            n, s = named[i]
            part.append((n, torch.randn(s, generator=g, device="cuda", dtype=torch.float32).mul_(0.02).to(dt)))
            size += part[-1][1].numel() * dt.itemsize
            i += 1
        buffer, bucket = make_bucket(part)
        del part
        conn.send_bytes(pickle.dumps(bucket))
        assert conn.recv() == "done"  # applied: the buffer may go
        del buffer
    conn.send_bytes(b"")
    conn.send(time.perf_counter() - t0)


def _used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def run_model(name: str, args) -> dict:
    import torch

    from turnout import LLM, SamplingParams
    from turnout.entrypoints.bench_models import resolve_model

    model_dir = resolve_model(name)[0]
    llm = LLM(model_dir, load_format="dummy", dtype=args.dtype, seed=0, max_model_len=2048,
              gpu_memory_utilization=args.gpu_memory_utilization)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[(13 * i + 7 * j) % 5000 + 10 for j in range(20 + 9 * i)] for i in range(4)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    torch.cuda.synchronize()
    used, held = _used(), torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    llm.sleep(level=1)
    sleep_s = time.perf_counter() - t0
    freed = used - _used()
    t0 = time.perf_counter()
    llm.wake_up()
    torch.cuda.synchronize()
    wake_s = time.perf_counter() - t0
    graphs = llm.engine.runner.graphs
    after_wake = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_trainer, args=(model_dir, args.dtype, args.bucket_mb, theirs), daemon=True)
    proc.start()
    nbytes = mine.recv()
    engine_s, buckets = 0.0, 0
    t_first = None
    while msg := mine.recv_bytes():
        if t_first is None:
            t_first = time.perf_counter()
        t0 = time.perf_counter()
        llm.update_weights_from_ipc([pickle.loads(msg)])
        engine_s += time.perf_counter() - t0
        buckets += 1
        mine.send("done")
    wall_s = time.perf_counter() - t_first
    trainer_s = mine.recv()
    proc.join(60)
    after_update = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    row = {"model": name, "dtype": args.dtype, "held_GiB": round(held / 2**30, 2),
           "sleep1_freed_GiB": round(freed / 2**30, 2), "sleep1_freed_pct": round(100 * freed / held, 1),
           "sleep1_s": round(sleep_s, 3), "wake_up_s": round(wake_s, 3),
           "graph_capture_s": round(getattr(graphs, "capture_s", 0.0) or 0.0, 3),
           "same_after_wake": after_wake == before,
           "update_GB": round(nbytes / 1e9, 2), "update_buckets": buckets, "update_wall_s": round(wall_s, 3),
           "update_engine_s": round(engine_s, 3), "update_GB_per_s": round(nbytes / 1e9 / wall_s, 1),
           "trainer_s": round(trainer_s, 3), "changed_after_update": after_update != before,
           "trainer_exit": proc.exitcode}
    del llm
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-8b,benchmarks/configs/qwen3_30b_a3b.json")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bucket-mb", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = []
    for name in args.models.split(","):
        rows.append(run_model(name, args))
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    report("RL rollout: sleep / wake / CUDA-IPC weight update", rows,
           ["model", "held_GiB", "sleep1_freed_pct", "sleep1_s", "wake_up_s", "graph_capture_s", "same_after_wake",
            "update_GB", "update_buckets", "update_wall_s", "update_engine_s", "update_GB_per_s",
            "changed_after_update"], {})


if __name__ == "__main__":
    main()
