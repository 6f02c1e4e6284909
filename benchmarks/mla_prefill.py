"""Latent attention's prefill, absorbed against decompressed, at DeepSeek-V3's attention shape (one layer's attention).

One sequence per case: ``new`` tokens over a context of ``context`` (the new ones included; new == context is a
fresh prompt, less is a chunk over a cached prefix). 128 heads, latent 512 + rope 64, no-rope 128, value 128, block
16, bf16, the latent cache filled. Timed, through the layer's own code (turnout/layers/mla.py,
turnout/layers/mla_prefill.py) on the op table's Triton kernels, projections before and o_proj after excluded (both
paths share them): ``absorbed`` (q_nope W_UK, ``mla_paged_attention``, W_UV) and ``decompressed`` (``mla_gather_cache``,
``kv_b_proj`` over the context, ``varlen_attention``). Reported per path: ms, new tokens/s, the FLOPs the model of
``decompress_pays`` counts and their rate, the bytes moved (latent cache read; the decompressed path's per-head
key/value workspace written and read) and their rate; and which path the rule picks against which was faster, so
the crossover can be checked (the rule counts FLOPs; a GPU may move it). The engine decompresses at most
``DECOMPRESS_WORKSPACE_BYTES`` of keys and values a step (4.6k keys at 128 heads): the longer cases here are forced
past that bound, to time the kernels.

On CPU (``--device cpu``) the same runs at a tiny shape under the Triton interpreter: the script's plumbing, not a
measurement.

Usage: python benchmarks/mla_prefill.py [--cases 4096x4096,2048x16384,128x8192] [--out DIR] [--device cuda]
Writes mla_prefill.json in --out and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

HEADS, LATENT, ROPE, NOPE, V, BLOCK = 128, 512, 64, 128, 128, 16
CASES = "4096x4096,16384x16384,2048x16384,512x8192,128x8192,64x16384"


def _time(fn, device: str) -> float:
    """Milliseconds a call: the median of 5 (after 2 warm-up calls on a GPU, events around each)."""
    if device == "cuda":
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(5 if device == "cuda" else 1):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def build_layer(ops, heads, latent, rope, nope, v, dtype, device):
    from transformers import DeepseekV3Config

    from turnout.layers.mla import MLAAttention
    from turnout.layers.rotary import RotaryEmbedding

    config = DeepseekV3Config(hidden_size=256, num_attention_heads=heads, num_key_value_heads=heads,
                              kv_lora_rank=latent, q_lora_rank=None, qk_rope_head_dim=rope, qk_nope_head_dim=nope,
                              v_head_dim=v, vocab_size=32, num_hidden_layers=1)
    with torch.device(device):
        rotary = RotaryEmbedding(nope + rope, torch.zeros(8, rope), False, ops)
        layer = MLAAttention(config, ops, rotary).to(dtype)
    layer.kv_b_proj.weight.data.normal_(0, latent ** -0.5)
    return layer


def case(ops, layer, new: int, context: int, dtype, device: str) -> dict:
    from turnout.layers.attention import AttentionMetadata
    from turnout.layers.mla_prefill import decompress_pays, decompressed_attention, plan_latent_prefill

    dev = torch.device(device)
    d = layer.latent_dims
    heads = layer.num_heads
    nblk = math.ceil(context / BLOCK)
    g = torch.Generator(device="cpu").manual_seed(0)
    table = torch.randperm(nblk, generator=g).view(1, nblk).to(dev, torch.int32)  # scattered blocks
    cache = torch.randn(nblk, BLOCK, d.kv_lora_rank + d.rope_dim, dtype=dtype, device=dev)
    q_nope = torch.randn(new, heads, d.nope_dim, dtype=dtype, device=dev) * d.nope_dim ** -0.5
    q_pe = torch.randn(new, heads, d.rope_dim, dtype=dtype, device=dev) * d.rope_dim ** -0.5
    meta = AttentionMetadata(slot_mapping=torch.full((new,), -1, dtype=torch.long, device=dev), block_tables=table,
                             seq_lens=torch.tensor([context], dtype=torch.int32, device=dev),
                             query_start_loc=torch.tensor([0, new], dtype=torch.int32, device=dev),
                             max_query_len=new, max_seq_len=context, seq_lens_host=(context,),
                             query_start_loc_host=(0, new))
    # forced, past the per-step workspace bound too (at 128 heads it is 4.6k keys): the kernels are what is timed
    plan = plan_latent_prefill(meta, "decompressed", dataclasses.replace(d, num_heads=1))
    pairs = new * (context - new) + new * (new + 1) // 2
    up = 2 * d.kv_lora_rank * (d.nope_dim + d.v_dim)
    flops = {"absorbed": heads * (pairs * (4 * d.kv_lora_rank + 2 * d.rope_dim) + new * up),
             "decompressed": heads * (pairs * 2 * (d.nope_dim + d.rope_dim + d.v_dim) + context * up)}
    latent_bytes = context * cache.shape[-1] * cache.element_size()
    workspace = context * heads * (2 * d.nope_dim + 2 * d.rope_dim + d.v_dim) * cache.element_size()
    moved = {"absorbed": latent_bytes * max(1, math.ceil(new / 2)),  # the context once per 2-token program
             "decompressed": latent_bytes + 2 * workspace}
    runs = {"absorbed": lambda: layer.absorbed(q_nope, q_pe, cache, meta),
            "decompressed": lambda: decompressed_attention(layer, q_nope, q_pe, cache, plan)}
    row = {"new": new, "context": context, "rule_picks": "decompressed" if decompress_pays(new, context, d)
           else "absorbed"}
    for name, fn in runs.items():
        ms = _time(fn, device)
        row[name] = {"ms": ms, "tokens_s": new / ms * 1e3, "flops": flops[name], "TFLOP_s": flops[name] / ms / 1e9,
                     "bytes": moved[name], "GB_s": moved[name] / ms / 1e6}
        if device == "cuda":
            torch.cuda.empty_cache()
    row["faster"] = min(runs, key=lambda n: row[n]["ms"])
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=CASES, help="new x context, comma-separated")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    device = args.device
    if device == "cpu":  # the interpreter at a tiny shape: the script's plumbing, not a measurement
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from turnout import envs

        envs.reload()
        shape, cases, dtype = (4, 32, 16, 16, 16), [(16, 16), (8, 40)], torch.float32
    else:
        shape, dtype = (HEADS, LATENT, ROPE, NOPE, V), torch.bfloat16
        cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    from turnout.ops import Policy, resolve
    from turnout.platforms import detect_platform

    names = ("mla_paged_attention", "mla_gather_cache", "varlen_attention")
    policy = Policy.parse(";".join(f"{n}=triton.default" for n in names), source="bench")
    ops = resolve(detect_platform(device), policy)
    layer = build_layer(ops, *shape, dtype, device)
    rows = []
    with torch.inference_mode():
        for new, context in cases:
            rows.append(case(ops, layer, new, context, dtype, device))
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
              "shape": dict(zip(("heads", "latent", "rope", "nope", "v"), shape)), "block": BLOCK, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mla_prefill.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(result["device"])
    print(f"{'new x ctx':>14} {'path':>12} {'ms':>9} {'tok/s':>10} {'TFLOP/s':>8} {'GB/s':>8}  rule / faster")
    for r in rows:
        for name in ("absorbed", "decompressed"):
            p = r[name]
            tail = f"{r['rule_picks']} / {r['faster']}" if name == "absorbed" else ""
            print(f"{r['new']:>6} x {r['context']:<6} {name:>12} {p['ms']:>9.3f} {p['tokens_s']:>10.0f} "
                  f"{p['TFLOP_s']:>8.1f} {p['GB_s']:>8.0f}  {tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
