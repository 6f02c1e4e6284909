"""The embedded SmolLM2-135M on CPU, one forward of 1 and of 32 tokens, today's float32 load beside the Q4_1
projections kept in 4 bits (``quantization="gguf"``: float32 through vendor.cpu's slab dequantisation, and bfloat16
through torch's int4 kernel), interleaved in one process so that a shared machine's noise falls on all three alike
(best of 5). Also the anonymous resident-memory growth of loading each (benchmarks/cpu_generate.py).

    PYTHONPATH=$PWD python benchmarks/cpu_w4_forward.py
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "quant"))
VARIANTS = {"float32": {}, "gguf": {"quantization": "gguf"}, "gguf-bf16": {"quantization": "gguf", "dtype": "bfloat16"}}


def main():
    from fp8_checkpoints import forward_logits
    from turnout.layers.layout import use_k_major_weights
    from turnout.loader import load_model
    from turnout.ops import resolve
    from turnout.platforms.detect import detect_platform

    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    ops = resolve(detect_platform("cpu"))
    models = {}
    for name, kw in VARIANTS.items():
        lm = load_model(None, ops=ops, device="cpu", **kw)
        use_k_major_weights(lm.model)  # as the model runner does on CPU
        models[name] = lm
    best = {f"{n} T={t}": float("inf") for n in models for t in (1, 32)}
    for _ in range(5):
        for t in (1, 32):
            ids = torch.arange(t) + 100
            for n, lm in models.items():
                start = time.perf_counter()
                forward_logits(lm.model, lm.hf_config, ids)
                best[f"{n} T={t}"] = min(best[f"{n} T={t}"], time.perf_counter() - start)
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpu_generate", os.path.join(HERE, "cpu_generate.py"))
    cpu_generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_generate)
    load_growth_mb = cpu_generate.load_growth_mb

    out = {"forward_ms": {k: round(v * 1e3, 1) for k, v in best.items()},
           "load_MB": {n: round(load_growth_mb(n), 1) for n in models},
           "weight_MB": {n: round(sum(p.numel() * p.element_size() for p in lm.model.parameters()) / 1e6, 1)
                         for n, lm in models.items()}}
    for k, v in out["forward_ms"].items():
        print(f"{k:16s} {v:8.1f} ms")
    print("JSON " + json.dumps(out))


if __name__ == "__main__":
    main()
