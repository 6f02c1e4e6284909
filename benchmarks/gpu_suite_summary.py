"""Fold the GPU suite's outputs (benchmarks/gpu_suite.sh OUTDIR) into OUTDIR/summary.json.

Run after every step, so it must cope with anything missing, partial or malformed: what it cannot read
it reports under "unreadable" and moves on. "headline" holds the numbers docs/benchmarks.md wants.

    python benchmarks/gpu_suite_summary.py OUTDIR
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

BENCH_FILES = ("lat_graphs", "lat_eager", "throughput", "prefill", "moe_b1", "moe_b64")


def _load_json(path: str, problems: dict):
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001
        problems[os.path.basename(path)] = f"{type(e).__name__}: {e}"
        return None


STEP_FILES = ("steps.jsonl", "steps_tests.jsonl", "steps_bench.jsonl", "steps_all.jsonl")  # one per part


def _steps(out: str, problems: dict) -> list[dict]:
    """Every part's steps found in ``out`` (both parts may share one OUTDIR), each tagged with its part."""
    steps = []
    for name in STEP_FILES:
        path = os.path.join(out, name)
        if not os.path.exists(path):
            continue
        part = name[len("steps_"):-len(".jsonl")] if name != "steps.jsonl" else None
        for line in open(path):
            line = line.strip()
            if line:
                try:
                    steps.append({**json.loads(line), **({"part": part} if part else {})})
                except json.JSONDecodeError as e:
                    problems[name] = str(e)
    return steps


def _junit(path: str, problems: dict):
    if not os.path.exists(path):
        return None
    try:
        root = ET.parse(path).getroot()
    except Exception as e:  # noqa: BLE001
        problems[os.path.basename(path)] = f"{type(e).__name__}: {e}"
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tot = {k: sum(int(s.get(k, 0) or 0) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    tot["passed"] = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
    bad = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            el = case.find(kind)
            if el is not None:
                msg = (el.get("message") or el.text or "").strip().splitlines()
                bad.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                            "message": (msg[0] if msg else "")[:400]})
    tot["not_passed"] = bad[:40]
    return tot


JUNIT_FILES = ("pytest_gpu.xml", "pytest_gpu_kernels.xml", "pytest_gpu_kernels2.xml")  # the groups run at once


def _merge_junit(parts: list) -> dict | None:
    """The GPU tests' counts over both groups' XML files (None where neither exists)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    tot = {k: sum(p[k] for p in parts) for k in ("tests", "failures", "errors", "skipped", "passed")}
    tot["not_passed"] = [b for p in parts for b in p["not_passed"]][:40]
    return tot


def _json_lines(path: str) -> list:
    """Objects printed as 'JSON {...}' lines (benchmarks/common.report's convention)."""
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path, errors="replace"):
        if line.startswith("JSON "):
            try:
                out.append(json.loads(line[5:]))
            except json.JSONDecodeError:
                pass
    return out


def _tail(path: str, n: int = 15) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return [ln.rstrip()[:300] for ln in f.readlines()[-n:]]


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def headline(r: dict) -> dict:
    lg, le, th, pf, hf = (r.get(k) or {} for k in ("lat_graphs", "lat_eager", "throughput", "prefill", "hf_peer"))
    h = {
        "model": lg.get("model") or th.get("model"),
        "gpu": _get(lg, "machine", "gpu") or _get(th, "machine", "gpu"),
        "copy_GB_s": _get(lg, "ceilings", "copy_GB_s") or _get(th, "ceilings", "copy_GB_s"),
        "gemm_TFLOP_s": _get(lg, "ceilings", "gemm_TFLOP_s") or _get(th, "ceilings", "gemm_TFLOP_s"),
        "cuda_graphs_enabled": _get(lg, "cuda_graphs", "enabled"),
        "cuda_graphs_reason": _get(lg, "cuda_graphs", "disabled_reason"),
        "cuda_graphs_replays": _get(lg, "cuda_graphs", "replays"),
        "b1_decode_tok_s_graphs": lg.get("decode_tok_s"),
        "b1_decode_step_ms_graphs": lg.get("decode_step_ms"),
        "b1_decode_GB_s_graphs": lg.get("decode_GB_s"),
        "b1_decode_frac_of_copy_bw_graphs": lg.get("decode_frac_of_copy_bw"),
        "b1_prefill_s": lg.get("prefill_s"),
        "b1_latency_s": lg.get("latency_s"),
        "b1_decode_tok_s_eager": le.get("decode_tok_s"),
        "b1_decode_step_ms_eager": le.get("decode_step_ms"),
        "graphs_speedup": _ratio(lg.get("decode_tok_s"), le.get("decode_tok_s")),
        "throughput_num_prompts": th.get("num_prompts"),
        "throughput_output_tok_s": th.get("output_tok_s"),
        "throughput_total_tok_s": th.get("total_tok_s"),
        "throughput_GB_s": th.get("achieved_GB_s"),
        "throughput_TFLOP_s": th.get("achieved_TFLOP_s"),
        "throughput_frac_of_gemm": th.get("frac_of_gemm"),
        "throughput_preemptions": th.get("num_preemptions"),
        "throughput_cuda_graph_replays": _get(th, "cuda_graphs", "replays"),
        "prefill_8x2048_s": pf.get("prefill_s"),
        "prefill_8x2048_tok_s": pf.get("prefill_tok_s"),
        "prefill_8x2048_TFLOP_s": pf.get("prefill_TFLOP_s"),
        "prefill_8x2048_frac_of_gemm": pf.get("prefill_frac_of_gemm"),
        "ops_chosen": lg.get("ops") or th.get("ops"),
    }
    hl = hf.get("latency") or {}
    for mode in ("eager", "static", "static_compiled"):
        v = _get(hl, mode, "decode_tok_s")
        if v is not None:
            h[f"hf_b1_decode_tok_s_{mode}"] = v
            h[f"b1_speedup_vs_hf_{mode}"] = _ratio(lg.get("decode_tok_s"), v)
    ht = hf.get("throughput") or {}
    if ht:
        h["hf_throughput_batch"] = ht.get("batch")
        h["hf_throughput_output_tok_s"] = ht.get("output_tok_s")
        h["throughput_speedup_vs_hf"] = _ratio(th.get("output_tok_s"), ht.get("output_tok_s"))
    same = hf.get("turnout_same_weights") or {}
    if same:
        h["hf_same_weights_identical"] = same.get("weights_identical")
        h["hf_same_weights_greedy_match"] = same.get("greedy_match")
        h["hf_same_weights_first_mismatch"] = same.get("first_mismatch")
        h["hf_same_weights_mismatches_all_near_ties"] = same.get("mismatches_all_near_ties")
    m1, m64, hm = (r.get(k) or {} for k in ("moe_b1", "moe_b64", "hf_moe"))
    if m1 or m64 or hm:
        h["moe_model"] = m1.get("model") or m64.get("model")
        h["moe_b1_decode_tok_s"] = m1.get("decode_tok_s")
        h["moe_b1_decode_frac_of_copy_bw"] = m1.get("decode_frac_of_copy_bw")
        h["moe_b64_output_tok_s"] = m64.get("output_tok_s")
        h["moe_b64_decode_tok_s"] = m64.get("decode_tok_s")
        h["hf_moe_b1_decode_tok_s"] = _get(hm, "latency", "eager", "decode_tok_s")
        h["hf_moe_b64_output_tok_s"] = _get(hm, "throughput", "output_tok_s")
        h["moe_b64_speedup_vs_hf"] = _ratio(m64.get("output_tok_s"), h["hf_moe_b64_output_tok_s"])
    return h


def build(out: str) -> dict:
    problems: dict = {}
    r: dict = {"outdir": out, "env": _load_json(os.path.join(out, "env.json"), problems),
               "steps": _steps(out, problems)}
    r["pytest_gpu"] = _merge_junit([_junit(os.path.join(out, name), problems) for name in JUNIT_FILES])
    ops = _load_json(os.path.join(out, "ops_check.json"), problems)
    if isinstance(ops, list):
        r["ops_check"] = {"impls_tested": len(ops), "passed": sum(1 for s in ops if s.get("passed")),
                          "failed": [{k: s.get(k) for k in ("op", "impl", "failed", "cases", "max_error", "failures")}
                                     for s in ops if not s.get("passed")],
                          "max_error": {f"{s.get('op')}/{s.get('impl')}": s.get("max_error") for s in ops}}
    elif ops is not None:
        r["ops_check"] = ops
    r["kernels"] = _load_json(os.path.join(out, "kernels.json"), problems) or _json_lines(
        os.path.join(out, "kernels.log"))
    for name in BENCH_FILES + ("hf_peer", "hf_moe"):
        r[name] = _load_json(os.path.join(out, f"{name}.json"), problems)
    for s in r["steps"]:  # failed steps: the end of their log says why
        if s.get("status") == "failed" and s.get("log"):
            s["log_tail"] = _tail(os.path.join(out, s["log"]))
    r["headline"] = headline(r)
    r["unreadable"] = problems
    return r


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = argv[0]
    summary = build(out)
    tmp = os.path.join(out, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, os.path.join(out, "summary.json"))
    print(json.dumps(summary["headline"], indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
