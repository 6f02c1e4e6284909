"""The offline benchmarks' result: the fields every JSON result carries and the table printed from it.
Apart from bench_cmd.py because the fields are the benchmarks' contract (tests and docs/gpu.md read them),
separate from how the engine is driven.
"""

from __future__ import annotations

import json
import sys

from turnout.kv.stats import format_tiers

# Fields every JSON result carries (tests check them; docs/gpu.md explains them).
COMMON_FIELDS = ("bench", "model", "model_path", "load_format", "dtype", "device", "input_len", "output_len",
                 "enforce_eager", "cuda_graphs", "ops", "engine", "geometry", "ceilings", "machine",
                 "achieved_GB_s", "achieved_TFLOP_s", "frac_of_copy_bw", "frac_of_gemm", "kv_tiers")
LATENCY_FIELDS = COMMON_FIELDS + ("batch_size", "num_iters", "latency_s", "latency_p50_s", "latency_p90_s",
                                  "latencies_s", "prefill_s", "prefill_tok_s", "prefill_TFLOP_s",
                                  "prefill_frac_of_gemm", "decode_step_ms", "decode_step_p50_ms",
                                  "decode_step_p90_ms", "decode_tok_s", "decode_GB_s", "decode_TFLOP_s",
                                  "decode_frac_of_copy_bw", "output_tok_s")
THROUGHPUT_FIELDS = COMMON_FIELDS + ("num_prompts", "elapsed_s", "requests_per_s", "output_tok_s",
                                     "total_tok_s", "num_steps", "num_prefill_steps", "num_decode_steps",
                                     "prefill_steps_s", "decode_steps_s", "decode_step_ms", "mean_decode_batch",
                                     "num_preemptions")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.1f}"
    return "-" if v is None else str(v)


TABLE = {"latency": ("latency_s", "prefill_s", "prefill_tok_s", "prefill_TFLOP_s", "prefill_frac_of_gemm",
                     "decode_step_ms", "decode_step_p90_ms", "decode_tok_s", "output_tok_s", "decode_GB_s",
                     "decode_frac_of_copy_bw", "decode_TFLOP_s"),
         "throughput": ("elapsed_s", "requests_per_s", "output_tok_s", "total_tok_s", "num_steps",
                        "decode_step_ms", "mean_decode_batch", "num_preemptions", "achieved_GB_s",
                        "frac_of_copy_bw", "achieved_TFLOP_s", "frac_of_gemm")}


def print_report(result: dict, out=None) -> None:
    out = out or sys.stdout
    g = result["cuda_graphs"]
    head = (f"== turnout bench {result['bench']}: {result['model']} ({result['dtype']}, {result['device']}), "
            f"input {result['input_len']}, output {result['output_len']}, "
            + (f"batch {result['batch_size']}" if result["bench"] == "latency" else f"{result['num_prompts']} prompts")
            + f", CUDA graphs {'on' if g.get('enabled') else 'off (' + str(g.get('disabled_reason')) + ')'}")
    print(head, file=out)
    keys = TABLE[result["bench"]]
    w = max(len(k) for k in keys)
    for k in keys:
        print(f"  {k:<{w}}  {_fmt(result.get(k))}", file=out)
    c = result["ceilings"]
    print(f"  ceilings: copy {_fmt(c.get('copy_GB_s'))} GB/s, GEMM {_fmt(c.get('gemm_TFLOP_s'))} TFLOP/s "
          f"({c.get('gemm_dtype', '-')})", file=out)
    sp = result.get("speculative")
    if sp:
        print(f"  speculative: {sp['method']} k={sp['num_speculative_tokens']}, {sp['num_accepted_tokens']} of "
              f"{sp['num_draft_tokens']} drafts accepted, mean accepted length {_fmt(sp['mean_accepted_length'])}",
              file=out)
    if result.get("kv_tiers"):
        print(f"  kv tiers: {format_tiers(result['kv_tiers'])}", file=out)
    print("JSON " + json.dumps(result), file=out)
