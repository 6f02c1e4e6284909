"""turnout's FlagGems plugin on a GPU: which sample cases FlagGems serves, per-op timings against turnout's Triton
kernels and the reference, greedy tokens and a decode step with FlagGems preferred. One JSON line per part and a
table (benchmarks/common.py:report). Run through benchmarks/flaggems_ops.sh (installs the carried wheels).

    python benchmarks/flaggems_ops.py [--parts cases,timings,tokens] [--output-json out.json]

- cases: every sample case of every op the plugin serves (each dtype), the FlagGems wrapper with the real library
  against the reference through the conformance suite's case runner; per case whether FlagGems served it or the
  wrapper sent it to the next implementation (and why).
- timings: ms per call (CUDA events, best of 3 rounds) of vendor.flaggems, triton.default and reference.torch at
  decode (64 tokens) and prefill (4096 tokens) shapes (benchmarks/flaggems_shapes.py), the max error of each
  against the reference, and whether FlagGems served the shape.
- tokens: greedy tokens of the embedded SmolLM2 and of Qwen3-8B with dummy weights, default table vs FlagGems
  preferred (``prefer_policy()``) vs FlagGems preferred with turnout's fused decode kernels off
  (``prefer_policy(exclusive=True)``), and the decode step's ms per token (batch 1, CUDA graphs) of each.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import report  # noqa: E402

IMPLS = ("vendor.flaggems", "triton.default", "reference.torch")


def _table(op, policy_text=None):
    from turnout.ops import Policy, default_registry
    from turnout.ops.resolution import resolve_op
    from turnout.platforms import detect_platform

    platform = detect_platform()
    policy = Policy.parse(policy_text) if policy_text else Policy.from_sources(platform=platform)
    return resolve_op(op, default_registry(), platform, policy), platform


def cases() -> list[dict]:
    from turnout_flaggems import OPS, library, prefer_policy

    from turnout.ops import default_registry
    from turnout.ops.conformance import run_case
    from turnout.ops.reference._util import DTYPES

    rows = []
    for op in OPS:
        res, platform = _table(op, prefer_policy())
        cand = res.candidate("vendor.flaggems")
        if not cand.available:
            rows.append({"op": op, "dtype": "-", "case": "-", "served_by": "unavailable", "why": cand.reason})
            continue
        spec = default_registry().ops[op]
        gen = torch.Generator().manual_seed(0)
        for dtype in spec.dtypes:
            for case in spec.sample_inputs(platform.device(0), DTYPES[dtype], gen):
                library.last_declined.pop(op, None)
                ok, err, msg = run_case(spec, cand.fn, case, dtype, platform)
                why = library.last_declined.get(op)
                rows.append({"op": op, "dtype": dtype, "case": case.label, "passed": ok, "max_error": err,
                             "served_by": "flaggems" if why is None else "next", "why": why or msg or ""})
    return rows


def _time(fn, args, kwargs, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            fn(*args, **kwargs)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def _error(spec, fn, args, kwargs):
    """Max |fn - reference| over the outputs (returned and written), on copies of the inputs."""
    import copy

    from turnout.ops.conformance import _outputs
    from turnout.ops.spec import SampleCase

    case = SampleCase("bench", args, kwargs)
    a, b = copy.deepcopy(case), copy.deepcopy(case)
    ref, got = spec.reference(*a.args, **a.kwargs), fn(*b.args, **b.kwargs)
    errs = [(x.float() - y.float()).abs().max().item() for x, y in zip(_outputs(spec, a, ref), _outputs(spec, b, got))
            if x.numel()]
    return max(errs) if errs else 0.0


def timings(reps: int) -> list[dict]:
    from turnout_flaggems import OPS, library

    from benchmarks.flaggems_shapes import inputs
    from turnout.ops import default_registry

    rows = []
    for op in OPS:
        res, platform = _table(op)
        spec = default_registry().ops[op]
        for phase in ("decode", "prefill"):
            torch.manual_seed(0)
            args, kwargs = inputs(op, phase, platform.device(0))
            row = {"op": op, "phase": phase, "tokens": len(args[1]) if op == "rotary_embedding" else len(args[0])}
            for impl in IMPLS:
                cand = next((c for c in res.candidates if c.impl == impl), None)
                key = impl.split(".")[0]
                if cand is None or not cand.available:
                    row[f"{key}_ms"] = None
                    row[f"{key}_why"] = "no such implementation" if cand is None else cand.reason
                    continue
                library.last_declined.pop(op, None)
                try:
                    row[f"{key}_err"] = _error(spec, cand.fn, args, kwargs)
                    row[f"{key}_ms"] = _time(cand.fn, args, kwargs, reps if impl != "reference.torch" else 3)
                except Exception as e:  # one broken kernel is a row, not the end of the run
                    row[f"{key}_ms"], row[f"{key}_why"] = None, f"{type(e).__name__}: {e}"[:300]
                if impl == "vendor.flaggems":
                    row["flaggems_served"] = op not in library.last_declined
                    if op in library.last_declined:
                        row["flaggems_why"] = library.last_declined[op]
            if row.get("vendor_ms") and row.get("triton_ms"):
                row["flaggems_vs_triton"] = round(row["vendor_ms"] / row["triton_ms"], 3)
            rows.append(row)
            del args, kwargs
            torch.cuda.empty_cache()
    return rows


PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):",
           "The three laws of thermodynamics are"]
ID_PROMPTS = [list(range(100 + 997 * i, 116 + 997 * i)) for i in range(4)]  # a config-only model has no tokenizer


def _engine_run(model, policy, dummy):
    from turnout import LLM, SamplingParams

    kw = dict(load_format="dummy", max_model_len=1024) if dummy else dict(max_model_len=1024)
    t0 = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", ops_policy=policy, gpu_memory_utilization=0.5, **kw)
    start_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = ID_PROMPTS if dummy else PROMPTS
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    chosen = {op: llm.engine.runner.ops.chosen(op) for op in llm.engine.runner.ops.resolutions}
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True)
    llm.generate(prompts[:1], many, use_tqdm=False)  # warm
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompts[:1], one, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(prompts[:1], many, use_tqdm=False)
        t2 = time.perf_counter()
        best = min(best, ((t2 - t1) - (t1 - t0)) / 128 * 1e3)
    llm.shutdown()  # the weights and the KV cache, before the next table's engine sizes its own
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, chosen, best, start_s


TOKEN_MODELS = {"embedded": ("SmolLM2-135M (embedded)", None, False),
                "qwen3-8b": ("Qwen3-8B (dummy)", "benchmarks/configs/qwen3-8b", True)}


def tokens_and_step(models=tuple(TOKEN_MODELS)) -> list[dict]:
    from turnout_flaggems import prefer_policy

    rows = []
    for name, model, dummy in (TOKEN_MODELS[m] for m in models):
        if model is not None:
            from turnout.entrypoints.bench_models import resolve_model

            model = resolve_model(model)[0]
        base = None
        tables = [("default", None), ("flaggems", prefer_policy()), ("flaggems exclusive", prefer_policy(exclusive=True))]
        if dummy:  # an 8B model's decode path under the plain preference is turnout's fused kernels: skip it
            del tables[1]
        for label, policy in tables:
            try:
                toks, chosen, ms, start_s = _engine_run(model, policy, dummy)
            except Exception as e:
                rows.append({"model": name, "table": label, "error": f"{type(e).__name__}: {e}"[:400]})
                continue
            base = toks if base is None else base
            same = [a == b for a, b in zip(toks, base)]
            first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(toks, base)]
            rows.append({"model": name, "table": label, "greedy_equal_default": all(same), "first_diff": first_diff,
                         "decode_ms_per_token": round(ms, 3), "start_s": round(start_s, 1),
                         "on_flaggems": sorted(op for op, c in chosen.items() if c == "vendor.flaggems")})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="cases,timings,tokens")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--token-models", default=",".join(TOKEN_MODELS),
                    help=f"the tokens part's models, of {', '.join(TOKEN_MODELS)}")
    args = ap.parse_args()
    token_models = args.token_models.split(",")
    if unknown := set(token_models) - set(TOKEN_MODELS):
        ap.error(f"--token-models: unknown {', '.join(sorted(unknown))} (known: {', '.join(TOKEN_MODELS)})")
    if not torch.cuda.is_available():
        print("flaggems_ops.py needs a GPU", file=sys.stderr)
        return 2
    import flag_gems

    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "flag_gems": flag_gems.__version__}
    parts = args.parts.split(",")
    if "cases" in parts:
        rows = cases()
        out["cases"] = rows
        summary = {}
        for r in rows:
            s = summary.setdefault(r["op"], {"op": r["op"], "flaggems": 0, "next": 0, "failed": 0, "why_next": set()})
            s["flaggems" if r["served_by"] == "flaggems" else "next"] += 1
            s["failed"] += not r.get("passed", True)
            if r["served_by"] != "flaggems":
                s["why_next"].add(r["why"][:80])
        srows = [{**s, "why_next": "; ".join(sorted(s["why_next"]))} for s in summary.values()]
        report("FlagGems: sample cases served / sent on / failed", srows,
               ["op", "flaggems", "next", "failed", "why_next"], {"cases": rows})
    if "timings" in parts:
        rows = timings(args.reps)
        out["timings"] = rows
        report("ms per call: FlagGems vs turnout Triton vs reference", rows,
               ["op", "phase", "tokens", "vendor_ms", "triton_ms", "reference_ms", "flaggems_vs_triton",
                "flaggems_served", "vendor_err", "triton_err"], {})
    if "tokens" in parts:
        rows = tokens_and_step(token_models)
        out["tokens"] = rows
        report("greedy tokens and decode step, FlagGems preferred", rows,
               ["model", "table", "greedy_equal_default", "first_diff", "decode_ms_per_token", "error"], {})
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
