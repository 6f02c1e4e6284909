"""The ``moe`` part of benchmarks/w4a16.py: one Qwen3-30B-A3B-shaped routed-expert layer (E = 128, H = 2048,
I = 768, top-8, group 128) in 4 bits (``moe_experts_w4a16``, Triton grouped kernel) beside bf16 (``moe_experts``,
Triton, its own decode / grouped choice), at T tokens of random routing, CUDA graph of launches.

For each T: microseconds of each; the bytes the layer must read (the experts the routing touches: 4-bit values plus
bf16 scale and zero per group of 128, against 2 bytes a weight for bf16); GB/s and the fraction of the copy
bandwidth measured in this run (the copy ceiling: no kernel reads its weights faster than a device copy); TFLOP/s
(2 x 3 I H flops per token and slot). ``--smoke`` runs tiny shapes on the CPU (vendor.cpu against the float
reference), which checks the script, not the speed.
"""

from __future__ import annotations

import torch

E, H, I, TOP_K, GROUP = 128, 2048, 768, 8, 128
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)


def _impls(dev):
    if dev.type == "cuda":
        from turnout.ops.triton.moe import moe_experts
        from turnout.ops.triton.moe_w4a16 import moe_experts_w4a16

        return moe_experts_w4a16, moe_experts
    from turnout.ops.reference.moe import moe_experts
    from turnout.ops.vendors.cpu.moe_w4a16 import moe_experts_w4a16

    return moe_experts_w4a16, moe_experts


def _routing(t: int, e: int, k: int, dev, gen):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(dev, torch.int32)
    weights = torch.rand((t, k), generator=gen).to(dev) / k
    return weights, ids


def moe(args, timer, copy_gb_s: float) -> dict:
    from turnout.ops.reference.moe_w4a16 import random_experts

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    e, h, i, k, g, tokens = (E, H, I, TOP_K, GROUP, TOKENS) if not args.smoke else (8, 128, 128, 2, 64, (1, 16))
    w4, bf16 = _impls(dev)
    gen = torch.Generator().manual_seed(0)
    q13, s13, q2, s2 = random_experts(e, h, i, g, dtype, dev, gen)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(dev, dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(dev, dtype)
    w4_expert = (2 * i * h + h * i) // 2 + (s13[0].numel() + s2[0].numel()) * s13.element_size()
    bf16_expert = 3 * i * h * w13.element_size()
    out = {"shape": {"experts": e, "hidden": h, "intermediate": i, "top_k": k, "group": g}, "rows": []}
    for t in tokens:
        cases = []
        for _ in range(4):  # several routings, so that the graph replays more than one pattern
            weights, ids = _routing(t, e, k, dev, gen)
            cases.append(((torch.randn(t, h, generator=gen) * 0.5).to(dev, dtype), weights, ids))
        active = sum(torch.unique(c[2]).numel() for c in cases) / len(cases)  # experts whose weights are read
        s_w4 = timer(lambda x, w, ids: w4(x, q13, s13, q2, s2, w, ids, g), cases)
        s_bf16 = timer(lambda x, w, ids: bf16(x, w13, w2, w, ids), cases)
        b_w4, b_bf16, flops = active * w4_expert, active * bf16_expert, 2 * 3 * i * h * t * k
        row = {"tokens": t, "active_experts": round(active, 1), "w4_us": s_w4 * 1e6, "bf16_us": s_bf16 * 1e6,
               "speedup_vs_bf16": s_bf16 / s_w4, "w4_GB_s": b_w4 / s_w4 / 1e9,
               "w4_frac_copy": b_w4 / s_w4 / 1e9 / copy_gb_s, "bf16_frac_copy": b_bf16 / s_bf16 / 1e9 / copy_gb_s,
               "w4_copy_ceiling_us": b_w4 / copy_gb_s / 1e3, "w4_TFLOP_s": flops / s_w4 / 1e12,
               "bf16_TFLOP_s": flops / s_bf16 / 1e12}
        out["rows"].append({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()})
        print("moe " + ", ".join(f"{a} {b:.4g}" for a, b in row.items()), flush=True)
        if args.smoke:  # the script's arithmetic, checked: the CPU path against the float reference's scale
            assert torch.isfinite(w4(*cases[0][:1], q13, s13, q2, s2, *cases[0][1:], g)).all()
    return out
