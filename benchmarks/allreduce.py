"""all_reduce through turnout's collective op (torch.distributed on the platform's backend: NCCL on GPUs,
gloo on CPU) against a device-to-device copy of the same bytes, measured in the same run.

    torchrun --nproc-per-node 2 benchmarks/allreduce.py --hidden 4096 --json out.json
    SMOKE: torchrun --nproc-per-node 2 benchmarks/allreduce.py --device cpu --sizes 1,8

Sizes are rows of ``hidden`` bf16 values: 1 row is a batch-1 decode step's all-reduce, 8192 rows a prefill
chunk's. Rank 0 prints a table and one JSON line: latency (µs) and bus bandwidth (2 (W-1)/W x bytes / time,
NCCL's convention) per size, beside the copy's GB/s (read + write) on rank 0's device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--sizes", default="1,8,64,256,1024,4096,8192")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from turnout.distributed.parallel_state import destroy_distributed, init_distributed
    from turnout.ops import resolve
    from turnout.platforms import detect_platform

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    platform = detect_platform(args.device)
    init_distributed(platform, rank=rank, world_size=world, init_method="env://",
                             device=torch.device(args.device, torch.cuda.current_device()) if cuda else None)
    ops = resolve(platform, ops=["all_reduce"])
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        x = torch.ones(n, args.hidden, dtype=dtype, device=args.device)
        for _ in range(5):
            ops.all_reduce(x)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            ops.all_reduce(x)
        sync()
        dt = (time.perf_counter() - t0) / args.iters
        nbytes = x.numel() * x.element_size()
        src, dst = torch.empty_like(x), torch.empty_like(x)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dst.copy_(src)
        sync()
        ct = (time.perf_counter() - t0) / args.iters
        rows.append({"rows": n, "bytes": nbytes, "allreduce_us": round(dt * 1e6, 2),
                     "bus_GBps": round(2 * (world - 1) / world * nbytes / dt / 1e9, 3),
                     "copy_us": round(ct * 1e6, 2), "copy_GBps": round(2 * nbytes / ct / 1e9, 1)})
    if rank == 0:
        from common import report

        report(f"all_reduce ({ops.chosen('all_reduce')}) over {world} ranks, {dtype}, hidden {args.hidden}", rows,
               ["rows", "bytes", "allreduce_us", "bus_GBps", "copy_us", "copy_GBps"], {"world": world})
        if args.json:
            json.dump({"world": world, "rows": rows}, open(args.json, "w"))
    torch.distributed.barrier()  # rank 1 leaving while rank 0 still reports aborted the gloo world on exit
    destroy_distributed()


if __name__ == "__main__":
    main()
