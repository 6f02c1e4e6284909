"""4-bit weights (w4a16) on the GPU: the kernels alone, then the engine in 4 bits beside bf16 and fp8.

Parts (``--parts``, comma-separated; each writes OUTDIR/<part>.json as soon as it is measured):

  kernels     copy bandwidth measured in this run; for each projection of the model (Qwen3-8B: qkv, o, gate_up,
              down), group 128: the one-row w4a16_linear (Triton, CUDA graph of launches) in GB/s of the bytes it
              must read (4-bit values + bf16 scale and zero per group) and as a fraction of the copy bandwidth,
              beside the bf16 small_m_linear and the fp8 fp8_linear one-row kernels; then the prefill GEMM
              (M = 2048) in TFLOP/s beside bf16 torch.mm
  latency     turnout bench latency, batch 1, 128 in / 256 out, CUDA graphs, dummy weights: the model as an AWQ
              group-128 checkpoint (its config with an AWQ quantization_config), beside bf16 and --quantization fp8
  throughput  512 x (1024 in / 512 out), w4a16 beside bf16
  moe         one Qwen3-30B-A3B-shaped routed-expert layer (128 experts, H 2048, I 768, top-8, group 128):
              moe_experts_w4a16 (Triton) beside bf16 moe_experts at T = 1 ... 4096, against the copy ceiling of the
              experts' bytes the routing touches (benchmarks/w4a16_moe.py)

    PYTHONPATH=$PWD python benchmarks/w4a16.py --out /tmp/w4 --parts kernels,latency
    PYTHONPATH=$PWD python benchmarks/w4a16.py --out /tmp/w4 --parts throughput
    PYTHONPATH=$PWD python benchmarks/w4a16.py --out /tmp/w4 --parts moe
    PYTHONPATH=$PWD python benchmarks/w4a16.py --smoke          # tiny shapes on the CPU (the ops, no engine)

``--model``: a benchmarks/configs name or a config file / directory (default qwen3-8b).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
GROUP = 128
AWQ = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}


def _config_path(model: str) -> str:
    for cand in (model, os.path.join(HERE, "configs", model), os.path.join(HERE, "configs", model + ".json")):
        if os.path.exists(cand):
            return cand
    raise SystemExit(f"--model {model!r}: no such config (benchmarks/configs or a path)")


def _timer(dev):
    if dev.type == "cuda":
        from small_m_linear import time_graph

        return time_graph

    def time_host(fn, args_list, reps: int = 5) -> float:
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for a in args_list:
                fn(*a)
            best = min(best, (time.perf_counter() - t) / len(args_list))
        return best
    return time_host


def _impls(dev):
    """(w4a16, bf16 one-row, fp8 one-row or None) for this device: the Triton kernels on a GPU, the CPU's own on
    the host (the smoke run)."""
    if dev.type == "cuda":
        from turnout.ops.triton import fp8 as tfp8
        from turnout.ops.triton.linear import small_m_linear
        from turnout.ops.triton.w4a16 import w4a16_linear

        return w4a16_linear, small_m_linear, tfp8.fp8_linear
    from turnout.ops.vendors.cpu.w4a16 import w4a16_linear

    return w4a16_linear, torch.nn.functional.linear, None


def kernels(args) -> dict:
    from small_m_linear import shapes_of

    from turnout.ops.reference.fp8 import quantize_weight
    from turnout.ops.reference.w4a16 import random_w4
    from turnout.utils.roofline import copy_bandwidth

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    timer = _timer(dev)
    w4, one_row, fp8 = _impls(dev)
    out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "copy_GB_s": copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (1 << 26), 10),
           "decode": {}, "prefill": {}}
    shapes = {k: v for k, v in shapes_of(_config_path(args.model)).items() if not k.endswith("lm_head")}
    if args.smoke:
        shapes = {"tiny qkv": (384, 256), "tiny down": (256, 512)}
    gen = torch.Generator().manual_seed(0)
    m_prefill = 64 if args.smoke else 2048
    for name, (n, k) in shapes.items():
        qw, sz = random_w4(n, k, GROUP, dtype, dev, gen)
        wb = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dev, dtype)
        x1 = [(torch.randn(1, k, generator=gen).to(dev, dtype),) for _ in range(8)]
        w4_bytes = n * k // 2 + sz.numel() * sz.element_size()
        s_w4 = timer(lambda a: w4(a, qw, sz, GROUP), x1)
        s_bf16 = timer(lambda a: one_row(a, wb), x1)
        row = {"w4_us": s_w4 * 1e6, "w4_GB_s": w4_bytes / s_w4 / 1e9, "w4_frac_copy": w4_bytes / s_w4 / 1e9 /
               out["copy_GB_s"], "bf16_us": s_bf16 * 1e6, "bf16_GB_s": 2 * n * k / s_bf16 / 1e9,
               "speedup_vs_bf16": s_bf16 / s_w4}
        if fp8 is not None and torch.cuda.get_device_capability() >= (8, 9):
            wq, ws = quantize_weight(wb, "row")
            s_fp8 = timer(lambda a: fp8(a, wq, ws), x1)
            row.update(fp8_us=s_fp8 * 1e6, fp8_GB_s=n * k / s_fp8 / 1e9)
        out["decode"][name] = {key: round(v, 3) for key, v in row.items()}
        print(f"decode {name} N={n} K={k}: " + ", ".join(f"{a} {b:.3g}" for a, b in row.items()), flush=True)
        xm = torch.randn(m_prefill, k, generator=gen).to(dev, dtype)
        flops = 2 * m_prefill * n * k
        t_w4 = timer(lambda a: w4(a, qw, sz, GROUP), [(xm,)])
        t_bf16 = timer(lambda a: torch.nn.functional.linear(a, wb), [(xm,)])
        out["prefill"][name] = {"w4_TFLOP_s": round(flops / t_w4 / 1e12, 3),
                                "bf16_TFLOP_s": round(flops / t_bf16 / 1e12, 3)}
        print(f"prefill {name} M={m_prefill}: {out['prefill'][name]}", flush=True)
    dec = out["decode"].values()
    out["decode_total"] = {"w4_us": round(sum(r["w4_us"] for r in dec), 2),
                           "bf16_us": round(sum(r["bf16_us"] for r in dec), 2)}
    return out


def _awq_model(args) -> str:
    """A directory with the model's config plus an AWQ group-128 quantization_config (dummy weights)."""
    path = _config_path(args.model)
    cfg = json.load(open(os.path.join(path, "config.json") if os.path.isdir(path) else path))
    cfg["quantization_config"] = AWQ
    d = tempfile.mkdtemp(prefix="w4a16_model_")
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    return d


def _bench(args, name: str, extra: list[str], cap: int, model: str | None = None) -> dict:
    path = os.path.join(args.out, f"{name}.json")
    cmd = [sys.executable, "-m", "turnout.entrypoints.bench_cmd", "--log-level", "INFO", *extra,
           "--model", model or args.model, "--load-format", "dummy", "--dtype", "bfloat16", "--output-json", path]
    print("+", " ".join(cmd), flush=True)
    t = time.time()
    rc = subprocess.run(["timeout", str(cap), *cmd]).returncode
    result = json.load(open(path)) if os.path.exists(path) and rc == 0 else {"rc": rc}
    result["wall_s"] = time.time() - t
    return result


LAT = ["latency", "--batch-size", "1", "--input-len", "128", "--output-len", "256", "--num-iters", "3"]
THR = ["throughput", "--input-len", "1024", "--output-len", "512", "--max-num-seqs", "512",
       "--max-num-batched-tokens", "16384"]


def latency(args) -> dict:
    return {"w4a16": _bench(args, "latency_w4a16", LAT, 200, _awq_model(args)),
            "bf16": _bench(args, "latency_bf16", LAT, 150),
            "fp8": _bench(args, "latency_fp8", [*LAT, "--quantization", "fp8"], 200)}


def throughput(args) -> dict:
    thr = [*THR, "--num-prompts", str(args.num_prompts)]
    return {"w4a16": _bench(args, "throughput_w4a16", thr, 280, _awq_model(args)),
            "bf16": _bench(args, "throughput_bf16", thr, 250)}


def moe(args) -> dict:
    from w4a16_moe import moe as moe_layer

    from turnout.utils.roofline import copy_bandwidth

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    copy = copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (1 << 26), 10)
    result = moe_layer(args, _timer(dev), copy)
    return {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "copy_GB_s": copy, **result}


PARTS = {"kernels": kernels, "latency": latency, "throughput": throughput, "moe": moe}


def main():
    from common import report

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--out", default="/tmp/w4a16")
    ap.add_argument("--parts", default="kernels,latency")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the kernels and moe parts only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = ["kernels", "moe"] if args.smoke else args.parts.split(",")
    for part in parts:
        if part not in PARTS:
            raise SystemExit(f"--parts: unknown part {part!r} ({', '.join(PARTS)})")
        result = PARTS[part](args)
        json.dump(result, open(os.path.join(args.out, f"{part}.json"), "w"), indent=1)
        if part == "kernels":
            rows = [{"shape": k, **v} for k, v in result["decode"].items()]
            report(f"w4a16 one-row decode ({result['device']}, copy {result['copy_GB_s']:.0f} GB/s)", rows,
                   ["shape", "w4_us", "w4_GB_s", "w4_frac_copy", "bf16_us", "speedup_vs_bf16"], {"part": part})
        elif part == "moe":
            report(f"w4a16 MoE experts ({result['device']}, copy {result['copy_GB_s']:.0f} GB/s)", result["rows"],
                   ["tokens", "active_experts", "w4_us", "w4_copy_ceiling_us", "w4_frac_copy", "bf16_us",
                    "speedup_vs_bf16", "w4_TFLOP_s", "bf16_TFLOP_s"], {"part": part})
        else:
            print(f"JSON {json.dumps({'part': part, **result})}", flush=True)


if __name__ == "__main__":
    main()
