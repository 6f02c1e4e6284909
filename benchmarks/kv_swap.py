"""The KV swap ops alone on a GPU: each implementation of ``swap_layer`` / ``swap_layer_async``
moving scattered and consecutive blocks between the device cache and pinned host blocks, beside the
ceiling (one DMA of the same bytes, contiguous, measured in the same run), and how much of a per-layer
async swap-in hides behind a forward-like load (one GEMM per layer on the compute stream, each layer
waiting on its own event).

    python benchmarks/kv_swap.py                    # Qwen3-8B geometry: 36 layers, 8 KV heads x 128, bf16
    python benchmarks/kv_swap.py --blocks 94 --json out.json

Reported per implementation and case: GPU time (events on the stream the copy is ordered on), host time
to issue the copies (what the thread that launches the forward loses), GB/s over the bytes moved.
Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import json
import time

import torch

from turnout.worker.kv_transfer import ASYNC_AHEAD

IMPLS = {
    "triton.default": "turnout.ops.triton.swap",
    "vendor.cuda": "turnout.ops.vendors.cuda.swap",
}


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def timed(fn, iters: int) -> tuple[float, float]:
    """(median GPU ms, median host ms to issue) of fn() on the current stream."""
    gpu, host = [], []
    for i in range(iters + 1):
        a, b = _events()
        torch.cuda.synchronize()
        a.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        b.record()
        b.synchronize()
        if i:  # the first is a warm-up (compiles the kernel)
            gpu.append(a.elapsed_time(b))
            host.append((t1 - t0) * 1e3)
    return sorted(gpu)[len(gpu) // 2], sorted(host)[len(host) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--blocks", type=int, default=94, help="blocks per copy (a host-tier hit of ~1.5k tokens)")
    ap.add_argument("--device-blocks", type=int, default=2048)
    ap.add_argument("--host-blocks", type=int, default=1024)
    ap.add_argument("--gemm", type=int, default=2048, help="rows of the per-layer GEMM of the overlap load")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import importlib

    dtype = getattr(torch, args.dtype)
    shape = (args.block_size, args.kv_heads, args.head_dim)
    dev = [(torch.randn((args.device_blocks, *shape), device="cuda").to(dtype),
            torch.randn((args.device_blocks, *shape), device="cuda").to(dtype)) for _ in range(args.layers)]
    host = [(torch.empty((args.host_blocks, *shape), dtype=dtype, pin_memory=True),
             torch.empty((args.host_blocks, *shape), dtype=dtype, pin_memory=True)) for _ in range(args.layers)]
    block_bytes = 2 * args.layers * dev[0][0][0].numel() * dev[0][0].element_size()
    n = args.blocks
    g = torch.Generator().manual_seed(0)
    scattered_dev = torch.randperm(args.device_blocks, generator=g)[:n]
    scattered_host = torch.randperm(args.host_blocks, generator=g)[:n]
    cases = {
        "out scattered": (dev, host, torch.stack([scattered_dev, scattered_host], 1)),
        "in scattered": (host, dev, torch.stack([scattered_host, scattered_dev], 1)),
        "in consecutive": (host, dev, torch.stack([torch.arange(n), torch.arange(n) + 7], 1)),
    }
    moved = n * block_bytes
    # ceiling: the same bytes as one contiguous DMA each way
    flat_dev = torch.empty(moved, dtype=torch.uint8, device="cuda")
    flat_host = torch.empty(moved, dtype=torch.uint8, pin_memory=True)
    h2d, _ = timed(lambda: flat_dev.copy_(flat_host, non_blocking=True), args.iters)
    d2h, _ = timed(lambda: flat_host.copy_(flat_dev, non_blocking=True), args.iters)
    result = {"layers": args.layers, "block_bytes": block_bytes, "blocks": n, "bytes": moved,
              "ceiling": {"h2d_GB_s": moved / h2d / 1e6, "d2h_GB_s": moved / d2h / 1e6}, "impls": {}}

    # the overlap load: one GEMM per layer on the compute stream
    x = torch.randn((args.gemm, 4096), device="cuda", dtype=torch.bfloat16)
    w = torch.randn((4096, 4096 * 3), device="cuda", dtype=torch.bfloat16)

    def forward(before=None):
        for i in range(args.layers):
            if before is not None:
                before(i)
            torch.mm(x, w)

    fwd_ms, _ = timed(forward, args.iters)
    result["forward_ms"] = fwd_ms
    main_stream = torch.cuda.current_stream()
    side = torch.cuda.Stream(priority=-1)
    for impl, mod_name in IMPLS.items():
        mod = importlib.import_module(mod_name)
        r = {}
        for case, (src, dst, m) in cases.items():
            m = m.pin_memory()

            def copy(src=src, dst=dst, m=m):
                for s, d in zip(src, dst):
                    mod.swap_layer(list(s), list(d), m)

            ms, host_ms = timed(copy, args.iters)
            r[case] = {"gpu_ms": ms, "host_ms": host_ms, "GB_s": moved / ms / 1e6}
        src, dst, m = cases["in scattered"]
        m = m.pin_memory()

        def with_swap_in(src=src, dst=dst, m=m):
            side.wait_stream(main_stream)
            events = []

            def before(i):  # as KVTransfer does: copies issued ASYNC_AHEAD layers ahead of the layer about to run
                while len(events) < min(i + 1 + ASYNC_AHEAD, len(src)):
                    j = len(events)
                    events.append(mod.swap_layer_async(list(src[j]), list(dst[j]), m, stream=side))
                main_stream.wait_event(events[i])
            forward(before)

        both, host_ms = timed(with_swap_in, args.iters)
        copy_ms = r["in scattered"]["gpu_ms"]
        r["overlap"] = {"forward_ms": fwd_ms, "copy_ms": copy_ms, "forward_with_swap_in_ms": both,
                        "issue_host_ms": host_ms, "hidden": max(0.0, 1.0 - max(0.0, both - fwd_ms) / copy_ms)}
        result["impls"][impl] = r

    print(f"{n} blocks of {block_bytes / 2**20:.2f} MiB ({moved / 2**20:.0f} MiB); ceiling: one DMA "
          f"h2d {result['ceiling']['h2d_GB_s']:.1f} GB/s, d2h {result['ceiling']['d2h_GB_s']:.1f} GB/s; "
          f"forward-like load {fwd_ms:.2f} ms")
    print(f"{'impl':16} {'case':16} {'gpu ms':>8} {'host ms':>8} {'GB/s':>7}")
    for impl, r in result["impls"].items():
        for case in cases:
            c = r[case]
            print(f"{impl:16} {case:16} {c['gpu_ms']:8.2f} {c['host_ms']:8.2f} {c['GB_s']:7.1f}")
        o = r["overlap"]
        print(f"{impl:16} {'overlap':16} forward {o['forward_ms']:.2f} ms, with async swap-in "
              f"{o['forward_with_swap_in_ms']:.2f} ms, copy alone {o['copy_ms']:.2f} ms: hidden {o['hidden']:.0%}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
