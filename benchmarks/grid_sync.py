"""Is one persistent kernel with grid-wide barriers cheaper than a chain of PDL kernels? Measured, in Triton.

    python benchmarks/grid_sync.py [--layers 48]

A batch-1 MoE decode layer runs ~8 dependent phases, each needing all of the previous phase's output. Two
ways to run them: one kernel per phase, launched with programmatic dependent launch (PDL: what turnout
does), or one persistent kernel (a program per SM) with a grid-wide barrier between phases. This times
both, in CUDA graphs, on 8 phases per layer:

* empty phases: the cost of one kernel boundary against one barrier. Two barriers: polling with an atomic
  read-modify-write, and polling with volatile loads then one acquire;
* streaming phases of the byte sizes of a Qwen3-30B-A3B batch-1 layer (qkv, attention, split merge, o_proj,
  router, routing, gate/up, down): each phase sums its slice of a weight buffer.

A device copy measured in the same run is the ceiling. The barriers count arrivals on a 64-bit counter
that never resets (each barrier waits for the next multiple of the grid size), so graph replays need no
reset. Every program must be resident at once: grids are one or two programs per SM, far below the
occupancy limit. Prints JSON and a table. Needs a CUDA GPU with PDL (sm90+, Triton >= 3.3) for the chain.
"""

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import graph_replay_rounds  # noqa: E402
from turnout.ops.triton._pdl import pdl_args, pdl_wait  # noqa: E402

LAYER_MB = (21.0, 0.05, 0.1, 16.8, 0.5, 0.01, 50.3, 25.2)  # Qwen3-30B-A3B batch 1, per phase of a layer
BLOCK = 4096


@triton.jit
def _stream_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for off in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        o = off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _grid_barrier(ctr_ptr, G, VOLATILE_POLL: tl.constexpr):
    tl.debug_barrier()  # the whole program's writes precede its arrival
    old = tl.atomic_add(ctr_ptr, 1, sem="acq_rel", scope="gpu")
    target = (old // G + 1) * G
    cur = old + 1
    while cur < target:
        if VOLATILE_POLL:
            cur = tl.load(ctr_ptr, volatile=True)
        else:
            cur = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
    if VOLATILE_POLL:
        tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(x_ptr, offs_ptr, lens_ptr, n_phases, out_ptr, ctr_ptr, BLOCK: tl.constexpr,
                       VOLATILE_POLL: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for p in range(n_phases):
        base = tl.load(offs_ptr + p)
        n = tl.load(lens_ptr + p)
        for off in range(pid * BLOCK, n, G * BLOCK):
            o = off + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + base + o, mask=o < n, other=0.0).to(tl.float32)
        _grid_barrier(ctr_ptr, G, VOLATILE_POLL)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def _graph_ms(fn, reps: int = 20) -> float:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return min(graph_replay_rounds(graph, reps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("grid_sync.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from turnout.utils.roofline import copy_bandwidth

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sizes = [int(mb * 1e6 / 2) // 64 * 64 for mb in LAYER_MB] * args.layers
    phases = len(sizes)
    total = sum(sizes)
    x = torch.randn(total, device=dev, dtype=torch.bfloat16)
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    offs = torch.tensor(starts, device=dev, dtype=torch.int64)
    lens = torch.tensor(sizes, device=dev, dtype=torch.int64)
    empty = torch.full_like(lens, 64)
    out = torch.empty(4 * sms, device=dev)
    ctr = torch.zeros(1, device=dev, dtype=torch.int64)
    views = [x[s: s + n] for s, n in zip(starts, sizes)]
    copy_gb_s = copy_bandwidth(dev, 2 << 30)

    def chain(sizes_of, grid_of):
        def run():
            for v, n in zip(views, sizes_of):
                _stream_kernel[(grid_of(n),)](v, out, n, BLOCK=BLOCK, num_warps=8, **pdl_args(v))
        return run

    def persistent(lens_t, grid, volatile):
        return lambda: _persistent_kernel[(grid,)](x, offs, lens_t, phases, out, ctr, BLOCK=BLOCK,
                                                   VOLATILE_POLL=volatile, num_warps=8)

    res = {
        "sync_chain_pdl": _graph_ms(chain([64] * phases, lambda n: sms)),
        "sync_barrier_rmw_poll": _graph_ms(persistent(empty, sms, False)),
        "sync_barrier_volatile_poll": _graph_ms(persistent(empty, sms, True)),
        "stream_chain_pdl": _graph_ms(chain(sizes, lambda n: max(1, min(triton.cdiv(n, BLOCK), 4 * sms)))),
        "stream_persistent_rmw_poll": _graph_ms(persistent(lens, 2 * sms, False)),
        "stream_persistent_volatile_poll": _graph_ms(persistent(lens, 2 * sms, True)),
    }
    rows = [{"case": k, "ms": round(v, 4), "us_per_phase": round(v * 1e3 / phases, 3),
             "GB_s": round(2 * total / (v * 1e-3) / 1e9, 1) if k.startswith("stream") else None}
            for k, v in res.items()]
    summary = {"gpu": torch.cuda.get_device_name(), "phases": phases, "stream_bytes": 2 * total,
               "copy_GB_s": round(copy_gb_s, 1), "pdl": bool(pdl_args(x).get("PDL")), "results": rows}
    print(json.dumps(summary))
    print(f"\ncopy {copy_gb_s:.0f} GB/s; {phases} phases, {2 * total / 1e9:.2f} GB streamed in the stream cases")
    print(f"{'case':>32} {'ms':>8} {'us/phase':>9} {'GB/s':>7} {'% copy':>7}")
    for r in rows:
        bw = f"{r['GB_s']:7.0f} {100 * r['GB_s'] / copy_gb_s:6.1f}%" if r["GB_s"] else ""
        print(f"{r['case']:>32} {r['ms']:8.4f} {r['us_per_phase']:9.3f} {bw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
