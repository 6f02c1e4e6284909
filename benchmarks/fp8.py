"""FP8 on the GPU: the kernels alone, then the engine in fp8 beside bf16 and HF bf16.

Parts (``--parts``, comma-separated; each writes OUTDIR/<part>.json as soon as it is measured, and
OUTDIR/fp8_summary.json collects the ratios the issue asks for):

  kernels   copy bandwidth; prefill-shaped GEMMs (M = 8 x 2048) of the model's projections and a square 8192
            one: torch._scaled_mm (row-wise), the Triton scaled_mm / block_scaled_mm, bf16 torch.mm; the
            one-row fp8_linear decode kernel (GB/s of fp8 bytes) against bf16 small_m_linear. The best fp8
            GEMM rate is "the measured fp8 GEMM rate".
  latency   turnout bench latency, --quantization fp8, dummy weights: batch 1, 128 in / 256 out, CUDA graphs
            (fraction of copy bandwidth over the fp8 bytes: decode_GB_s / copy_GB_s); and bf16 beside it
  prefill   8 x 2048 in / 1 out in fp8: prefill TFLOP/s against the measured fp8 GEMM rate
  throughput  512 x (1024 in / 512 out) in fp8 (THROUGHPUT_BF16=1: bf16 too)
  throughput_kv  the same in fp8 with --kv-cache-dtype fp8
  hf        HF transformers bf16 on the same config (benchmarks/hf_peer.py: batch-1 latency, throughput)
  moe       Qwen3-30B-A3B (benchmarks/configs/qwen3_30b_a3b.json, whatever --model): the experts op alone, Triton
            moe_experts_fp8 against bf16 moe_experts at T = 1 .. 4096 (us, GB/s of the experts' weights a call
            reads); then turnout bench latency --quantization fp8 --load-format dummy at batch 1, 128 in / 256
            out, beside bf16 (fp8 experts in 128 x 128 blocks, the dense layers per channel)
  moe_b64   the same latency pair at batch 64

Two device calls of under 10 minutes on the H200 (a cold Triton cache compiles every kernel first):

    PYTHONPATH=$PWD python benchmarks/fp8.py --out /tmp/fp8 --parts kernels,latency,prefill
    PYTHONPATH=$PWD python benchmarks/fp8.py --out /tmp/fp8 --parts throughput,hf
    PYTHONPATH=$PWD python benchmarks/fp8.py --out /tmp/fp8 --parts moe
    PYTHONPATH=$PWD python benchmarks/fp8.py --out /tmp/fp8 --parts moe_b64

``--model`` is a benchmarks/configs name or a config file / directory (default qwen3-8b).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _config_path(model: str) -> str:
    for cand in (model, os.path.join(HERE, "configs", model), os.path.join(HERE, "configs", model + ".json")):
        if os.path.exists(cand):
            return cand
    raise SystemExit(f"--model {model!r}: no such config (benchmarks/configs or a path)")


def _time(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def kernels(args) -> dict:
    from small_m_linear import shapes_of, time_graph

    from turnout.ops.reference.fp8 import quantize_fp8, quantize_weight
    from turnout.ops.triton import fp8 as tfp8
    from turnout.ops.triton.linear import small_m_linear
    from turnout.utils.roofline import copy_bandwidth

    dev = torch.device("cuda")
    out = {"copy_GB_s": copy_bandwidth(dev, 2 << 30, 10), "gemm": {}, "decode": {}}
    shapes = {k: v for k, v in shapes_of(_config_path(args.model)).items() if not k.endswith("lm_head")}
    m = 8 * 2048
    for name, (n, k) in [*shapes.items(), ("square 8192", (8192, 8192))]:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev) * k ** -0.5
        wq_row, ws_row = quantize_weight(w, "row")
        wq_blk, ws_blk = quantize_weight(w, "block")
        xq, xs = quantize_fp8(x, 0)
        xg, xgs = quantize_fp8(x, 128)
        wb = w.bfloat16()
        flops = 2 * m * n * k
        row = {"bf16 torch.mm": flops / _time(lambda: x @ wb.T) / 1e12}
        if torch.cuda.get_device_capability() >= (9, 0) and hasattr(torch, "_scaled_mm"):
            wt, sb = wq_row.t(), ws_row.reshape(1, n).contiguous()
            row["torch._scaled_mm rowwise"] = flops / _time(
                lambda: torch._scaled_mm(xq, wt, scale_a=xs, scale_b=sb, out_dtype=torch.bfloat16)) / 1e12
        row["triton scaled_mm"] = flops / _time(lambda: tfp8.scaled_mm(xq, xs, wq_row, ws_row)) / 1e12
        row["triton block_scaled_mm"] = flops / _time(lambda: tfp8.block_scaled_mm(xg, xgs, wq_blk, ws_blk)) / 1e12
        row["triton fp8_linear (weight-only)"] = flops / _time(lambda: tfp8.fp8_linear(x, wq_row, ws_row)) / 1e12
        row["quantize_fp8 per token ms"] = _time(lambda: tfp8.quantize_fp8(x, 0)) * 1e3
        out["gemm"][name] = {key: round(v, 3) for key, v in row.items()}
        print(f"GEMM {name} M={m} N={n} K={k}: " + ", ".join(f"{a} {b:.1f}" for a, b in row.items()), flush=True)
        if name != "square 8192":
            x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            s_fp8 = time_graph(lambda a: tfp8.fp8_linear(a, wq_row, ws_row), [(x1,)] * 8)
            s_blk = time_graph(lambda a: tfp8.fp8_linear(a, wq_blk, ws_blk), [(x1,)] * 8)
            s_bf16 = time_graph(lambda a: small_m_linear(a, wb), [(x1,)] * 8)
            out["decode"][name] = {"fp8_row_GB_s": n * k / s_fp8 / 1e9, "fp8_block_GB_s": n * k / s_blk / 1e9,
                                   "bf16_small_m_GB_s": 2 * n * k / s_bf16 / 1e9,
                                   "fp8_row_us": s_fp8 * 1e6, "bf16_us": s_bf16 * 1e6}
            print(f"decode {name}: " + ", ".join(f"{a} {b:.1f}" for a, b in out["decode"][name].items()), flush=True)
        x = w = wq_row = wq_blk = xq = xg = wb = None  # free the memory now (not del: the closures above name them)
        torch.cuda.empty_cache()
    square = out["gemm"]["square 8192"]
    out["fp8_gemm_TFLOP_s"] = max(v for key, v in square.items() if "torch.mm" not in key and key.endswith(("mm",
                                  "rowwise")))
    return out


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


FP8 = ["--quantization", "fp8"]
LAT = ["--batch-size", "1", "--input-len", "128", "--output-len", "256", "--num-iters", "3"]


def latency(args) -> dict:
    return {"fp8": _bench(args, "latency_fp8", ["latency", *LAT, *FP8], 200),
            "bf16": _bench(args, "latency_bf16", ["latency", *LAT], 150)}


def prefill(args) -> dict:
    return {"fp8": _bench(args, "prefill_fp8", ["latency", "--batch-size", "8", "--input-len", "2048",
                                                 "--output-len", "1", "--num-iters", "3",
                                                 "--max-num-batched-tokens", "16384", *FP8], 150)}


THR = ["throughput", "--input-len", "1024", "--output-len", "512", "--max-num-seqs", "512",
       "--max-num-batched-tokens", "16384"]


def throughput(args) -> dict:
    thr = [*THR, "--num-prompts", str(args.num_prompts)]
    out = {"fp8": _bench(args, "throughput_fp8", [*thr, *FP8], 280)}
    if os.environ.get("THROUGHPUT_BF16") == "1":
        out["bf16"] = _bench(args, "throughput_bf16", thr, 250)
    return out


def throughput_kv(args) -> dict:
    """fp8 weights and an fp8 KV cache: a decode step at ~500 sequences reads the whole cache once (two thirds of
    the bf16-cache step, docs/benchmarks.md, "KV swaps as one kernel a layer"), so the cache's bytes bound the
    16,000 tok/s target."""
    thr = [*THR, "--num-prompts", str(args.num_prompts), "--kv-cache-dtype", "fp8"]
    return {"fp8": _bench(args, "throughput_fp8_kv", [*thr, *FP8], 280)}


def hf(args) -> dict:
    path = os.path.join(args.out, "hf_bf16.json")
    cmd = [sys.executable, os.path.join(HERE, "hf_peer.py"), "--model", args.model, "--dtype", "bfloat16",
           "--modes", "eager", "--output-json", path]
    rc = subprocess.run(["timeout", "280", *cmd]).returncode
    return json.load(open(path)) if os.path.exists(path) else {"rc": rc}


MOE_MODEL = "qwen3_30b_a3b"


def moe_experts_weights(model: str = MOE_MODEL):
    """A MoE config's experts on the GPU, random: ((hidden, intermediate, top_k, experts), bf16 w13, bf16 w2, and
    their fp8 128 x 128 block quantisation q13, s13, q2, s2 as moe_experts_fp8 takes them)."""
    from turnout.ops.reference.fp8 import quantize_weight

    cfg = json.load(open(_config_path(model)))
    h, inter, k = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    e = cfg.get("num_experts") or cfg["num_local_experts"]
    dev = torch.device("cuda")
    w13 = torch.randn(e, 2 * inter, h, device=dev) * h ** -0.5
    w2 = torch.randn(e, h, inter, device=dev) * inter ** -0.5
    q13, s13, q2, s2 = [], [], [], []
    for i in range(e):  # gate and up each with their own blocks, as the checkpoints store them
        parts = [quantize_weight(w13[i, :inter], "block"), quantize_weight(w13[i, inter:], "block")]
        q13.append(torch.cat([p[0] for p in parts]))
        s13.append(torch.cat([p[1] for p in parts]))
        q, s = quantize_weight(w2[i], "block")
        q2.append(q)
        s2.append(s)
    q13, s13, q2, s2 = (torch.stack(t) for t in (q13, s13, q2, s2))
    return (h, inter, k, e), w13.bfloat16(), w2.bfloat16(), q13, s13, q2, s2


def _moe_kernels() -> dict:
    """moe_experts_fp8 (Triton) against bf16 moe_experts (Triton) on Qwen3-30B-A3B's experts, random routings."""
    from turnout.ops.triton.moe import moe_experts
    from turnout.ops.triton.moe_fp8 import moe_experts_fp8

    (h, inter, k, e), w13, w2, q13, s13, q2, s2 = moe_experts_weights()
    dev = w13.device
    out = {}
    for t in (1, 8, 64, 512, 4096):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        ids = torch.rand(t, e, device=dev).topk(k, dim=1).indices.to(torch.int32)
        weights = torch.rand(t, k, device=dev)
        hit = torch.unique(ids).numel()
        bf16 = _time(lambda: moe_experts(x, w13, w2, weights, ids))
        fp8 = _time(lambda: moe_experts_fp8(x, q13, s13, q2, s2, weights, ids))
        per_expert = 3 * inter * h  # elements of w13 + w2
        row = {"bf16_us": bf16 * 1e6, "fp8_us": fp8 * 1e6, "bf16_GB_s": 2 * hit * per_expert / bf16 / 1e9,
               "fp8_GB_s": hit * per_expert / fp8 / 1e9, "experts_hit": hit}
        out[f"T{t}"] = {key: round(v, 2) for key, v in row.items()}
        print(f"moe_experts T={t}: " + ", ".join(f"{a} {b:.1f}" for a, b in row.items()), flush=True)
    return out


def _moe_latency(args, batch: int) -> dict:
    lat = ["latency", "--batch-size", str(batch), "--input-len", "128", "--output-len", "256", "--num-iters", "3"]
    return {"fp8": _bench(args, f"moe_latency_fp8_b{batch}", [*lat, *FP8], 240, MOE_MODEL),
            "bf16": _bench(args, f"moe_latency_bf16_b{batch}", lat, 200, MOE_MODEL)}


def moe(args) -> dict:
    return {"kernels": _moe_kernels(), "latency_batch1": _moe_latency(args, 1)}


def moe_b64(args) -> dict:
    return {"latency_batch64": _moe_latency(args, 64)}


def _get(d, *keys):
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def summary(out_dir: str) -> dict:
    def load(name):
        p = os.path.join(out_dir, f"{name}.json")
        return json.load(open(p)) if os.path.exists(p) else {}

    k, lat, pf, thr = load("kernels"), load("latency"), load("prefill"), load("throughput")
    moe_ = {**load("moe"), **load("moe_b64")}
    copy_bw = k.get("copy_GB_s") or _get(lat, "fp8", "ceilings", "copy_GB_s")
    fp8_rate = k.get("fp8_gemm_TFLOP_s")
    dec = _get(lat, "fp8", "results", "decode_GB_s") or _get(lat, "fp8", "decode_GB_s")
    pf_rate = _get(pf, "fp8", "results", "prefill_TFLOP_s") or _get(pf, "fp8", "prefill_TFLOP_s")
    s = {"copy_GB_s": copy_bw, "fp8_gemm_TFLOP_s": fp8_rate,
         "decode_tok_s_fp8": _get(lat, "fp8", "results", "decode_tok_s") or _get(lat, "fp8", "decode_tok_s"),
         "decode_tok_s_bf16": _get(lat, "bf16", "results", "decode_tok_s") or _get(lat, "bf16", "decode_tok_s"),
         "decode_fraction_of_copy": dec / copy_bw if dec and copy_bw else None,
         "prefill_TFLOP_s_fp8": pf_rate, "prefill_fraction_of_fp8_gemm": pf_rate / fp8_rate if pf_rate and fp8_rate
         else None,
         "throughput_output_tok_s_fp8": _get(thr, "fp8", "results", "output_tok_s") or _get(thr, "fp8", "output_tok_s"),
         "throughput_output_tok_s_bf16": _get(thr, "bf16", "results", "output_tok_s") or _get(thr, "bf16", "output_tok_s"),
         "throughput_output_tok_s_fp8_kv_fp8": _get(load("throughput_kv"), "fp8", "output_tok_s")}
    for batch in (1, 64):
        for dt in ("fp8", "bf16"):
            run = _get(moe_, f"latency_batch{batch}", dt)
            s[f"moe_decode_tok_s_{dt}_batch{batch}"] = _get(run, "results", "decode_tok_s") or _get(run, "decode_tok_s")
    json.dump(s, open(os.path.join(out_dir, "fp8_summary.json"), "w"), indent=1)
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--parts", default="kernels,latency,prefill")
    ap.add_argument("--num-prompts", type=int, default=512)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = {"kernels": kernels, "latency": latency, "prefill": prefill, "throughput": throughput,
             "throughput_kv": throughput_kv, "hf": hf, "moe": moe, "moe_b64": moe_b64}
    for part in args.parts.split(","):
        if part not in parts:
            raise SystemExit(f"--parts: unknown part {part!r} ({', '.join(parts)})")
        try:
            result = parts[part](args)
        except Exception as e:  # one part failing leaves the others' results
            result = {"error": f"{type(e).__name__}: {e}"}
            print(f"{part}: {result['error']}", flush=True)
        json.dump(result, open(os.path.join(args.out, f"{part}.json"), "w"), indent=1)
        print(json.dumps(summary(args.out)), flush=True)


if __name__ == "__main__":
    main()
