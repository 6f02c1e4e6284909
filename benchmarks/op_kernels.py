"""GPU micro-benchmark of the Triton kernels, decode paged attention first.

Times decode ``paged_attention`` (Qwen3-8B attention geometry: 32 query heads, 8 KV heads, head_dim 128,
block 16, bf16) with ``triton.testing.do_bench`` and reports the bandwidth achieved on the KV bytes it
must read, beside a device-to-device copy of the same number of bytes timed in the same run (the copy's
bandwidth counts its read and its write, so both numbers are memory traffic), with the PyTorch reference
and dense SDPA (KV pre-gathered, not paged) as peers. Also prints FLOP/s and tokens/s, then JSON.

    python benchmarks/op_kernels.py                      # batch 64 x 4096 context, plus batch 8 (split-KV)
    python benchmarks/op_kernels.py --batch 32 --context 8192 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def _paged_decode(batch, context, hq, hk, d, bs, dtype, device):
    import torch

    blocks_per_seq = context // bs
    num_blocks = batch * blocks_per_seq + 16
    k_cache = torch.randn((num_blocks, bs, hk, d), device=device, dtype=dtype)
    v_cache = torch.randn((num_blocks, bs, hk, d), device=device, dtype=dtype)
    # Scattered blocks, as a long-running block manager leaves them.
    tables = torch.randperm(num_blocks, device=device)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    query = torch.randn((batch, hq, d), device=device, dtype=dtype)
    args = (query, k_cache, v_cache, tables.to(torch.int32),
            torch.full((batch,), context, dtype=torch.int32, device=device),
            torch.arange(batch + 1, dtype=torch.int32, device=device), 1, context, 1.0 / math.sqrt(d))
    return args


def bench_decode_attention(batch, context, hq=32, hk=8, d=128, bs=16, with_reference=True, splits=(), device="cuda",
                           dtype=None):
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from turnout.ops.reference.attention import paged_attention as reference
    from turnout.ops.triton import attention

    dtype = dtype or torch.bfloat16
    args = _paged_decode(batch, context, hq, hk, d, bs, dtype, device)
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * batch * context * hk * d * elem
    flops = 4 * batch * hq * context * d  # QK^T and PV
    rows = []

    def add(name, ms, note=""):
        rows.append({"kernel": name, "batch": batch, "context": context, "ms": ms,
                     "kv_GBps": kv_bytes / ms / 1e6, "TFLOPs": flops / ms / 1e9, "tokens_per_s": batch / ms * 1e3,
                     "note": note})

    # The copy baseline, in the same run: as many bytes as the KV cache read, device to device.
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    copy_gbps = 2 * kv_bytes / copy_ms / 1e6  # read + write
    src = dst = None  # free the memory now (not del: the closures above name them)

    n_sms = attention._num_sms(torch.device(device).type, 0)
    chosen = attention.choose_num_splits(batch, hk, 1, context, n_sms)
    ms = do_bench(lambda: attention.paged_attention(*args), warmup=25, rep=200, return_mode="median")
    add("triton.default", ms, f"auto: {chosen} split(s)")
    for s in splits:
        if s != chosen:
            ms = do_bench(lambda s=s: attention.paged_attention_impl(*args, num_splits=s), warmup=25, rep=200,
                          return_mode="median")
            add(f"triton.default splits={s}", ms, "forced")

    # Dense SDPA over pre-gathered contiguous KV: what a non-paged kernel does with the same bytes.
    query, k_cache, v_cache, tables = args[:4]
    k = k_cache[tables.long()].reshape(batch, context, hk, d).transpose(1, 2).contiguous()
    v = v_cache[tables.long()].reshape(batch, context, hk, d).transpose(1, 2).contiguous()
    q = query.view(batch, hq, 1, d)
    try:
        ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), warmup=10, rep=100,
                      return_mode="median")
        add("torch SDPA (dense KV)", ms, "enable_gqa")
    except Exception as e:  # an older torch without enable_gqa
        add("torch SDPA (dense KV)", float("nan"), f"failed: {type(e).__name__}")
    k = v = None  # free the memory now (not del: the closures above name them)
    if with_reference:
        ms = do_bench(lambda: reference(*args), warmup=2, rep=300, return_mode="median")
        add("reference.torch", ms, "per-sequence loop")
    for r in rows:
        r["copy_GBps"] = copy_gbps
        r["fraction_of_copy"] = r["kv_GBps"] / copy_gbps
    return {"scenario": f"decode paged_attention B={batch} ctx={context} Hq={hq} Hk={hk} D={d} BS={bs} {str(dtype).split('.')[-1]}",
            "kv_bytes": kv_bytes, "copy_ms": copy_ms, "copy_GBps": copy_gbps, "rows": rows}


def _print_table(result):
    print(f"\n{result['scenario']}: KV {result['kv_bytes'] / 2**30:.2f} GiB; device copy of the same bytes "
          f"{result['copy_ms']:.3f} ms = {result['copy_GBps']:.0f} GB/s (read + write)")
    head = f"{'kernel':<28} {'ms':>9} {'KV GB/s':>9} {'of copy':>8} {'TFLOP/s':>8} {'tok/s':>10}  note"
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        print(f"{r['kernel']:<28} {r['ms']:>9.3f} {r['kv_GBps']:>9.0f} {r['fraction_of_copy']:>7.0%} "
              f"{r['TFLOPs']:>8.1f} {r['tokens_per_s']:>10.0f}  {r['note']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--small-batch", type=int, default=8, help="a second, split-KV scenario (0: skip)")
    ap.add_argument("--no-reference", action="store_true", help="skip the slow PyTorch reference")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("benchmarks/op_kernels.py: torch is not installed; nothing to time", file=sys.stderr)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/op_kernels.py: no GPU (torch.cuda.is_available() is False); skipped", file=sys.stderr)
        return 0
    torch.manual_seed(0)
    results = [bench_decode_attention(a.batch, a.context, with_reference=not a.no_reference, splits=(1, 2))]
    if a.small_batch:
        results.append(bench_decode_attention(a.small_batch, a.context, with_reference=False, splits=(1, 4, 16)))
    print(f"device: {torch.cuda.get_device_name(0)}")
    for r in results:
        _print_table(r)
    out = {"device": torch.cuda.get_device_name(0), "results": results}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
