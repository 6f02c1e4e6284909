"""A/B of settings inside a captured decode step: load a model once, re-capture its decode CUDA graph under
each setting, time replays, check the logits.

    python benchmarks/decode_step_ab.py --model benchmarks/configs/qwen3_30b_a3b.json \
        --settings '[{}, {"TURNOUT_SMALL_M_TILES": "{\"2048,4096\": [8, 1024, 4, 4]}"}, {"TURNOUT_PDL": "0"}]'

A setting is a set of environment variables (re-read through ``turnout.envs.reload()`` before each capture, and
looked up when kernels launch, hence at capture): ``TURNOUT_PDL``,
and the tile overrides of turnout/ops/triton/_tuning.py (``TURNOUT_SMALL_M_TILES``,
``TURNOUT_MOE_DECODE_CONFIG``); ``TURNOUT_ATTN_DECODE`` (decode attention's tiles, bound when an op table is
resolved) resolves a table for its setting and builds the model again over it. Model switches are also
accepted: ``"model:fused_prenorm": "0"`` captures
the step with the plain pre-norm kernels instead of norms fused into the projections (the fusion plan's
``prenorm_linear``), ``"model:rope_attention": "0"`` with q/k norm, RoPE and the cache write in their own
kernel instead of inside the attention kernel (``rope_attention``; on unless ``TURNOUT_ROPE_ATTENTION=0`` at
start-up); "1" turns either on where the op table allows it. A model's fusions are fixed when it is built
(turnout/layers/fusion.py), so a switch builds the model again with the other plan, on the meta device,
sharing the loaded model's weights (no copy).
A kernel's best tile alone is not always its best tile in the step, where it overlaps its neighbours (PDL)
and shares L2 with them; this measures the step itself, in one process, so settings are compared on the same
weights, GPU and clocks (the docs/benchmarks.md fourth-session tiles came from here).

Per setting: ms per step (best of 3 rounds of ``--reps`` replays), GB/s over the bytes a step reads (weights,
active experts and the KV cache of ``--context`` tokens per lane) and its fraction of the copy bandwidth
measured in the same run, whether replays repeat bit for bit, and whether the logits equal the first
setting's (a tile that changes the K split may change the last bits; a race would show as a repeat
mismatch). The peer for end-to-end numbers is benchmarks/gpu_suite.sh (HF transformers on the same
weights); this tool compares our settings with one another. Prints one JSON line per setting and a table.
Needs a CUDA GPU (graphs).
"""

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


MODEL_SWITCHES = ("model:fused_prenorm", "model:rope_attention")


def _settings(text: str) -> list[dict]:
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--settings is not valid JSON ({e})") from None
    if not isinstance(value, list) or not all(isinstance(s, dict) for s in value) or not value:
        raise SystemExit("--settings: a JSON list of objects (environment variable -> value)")
    unknown = sorted(k for s in value for k in s if k.startswith("model:") and k not in MODEL_SWITCHES)
    if unknown:
        raise SystemExit(f"--settings: unknown model switch(es) {unknown}; known: {list(MODEL_SWITCHES)}")
    return [{k: v if isinstance(v, str) else json.dumps(v) for k, v in s.items()} for s in value]


def _rebuilt(model, ops, plan):
    """``model``'s class built again with ``plan``, holding the same parameter and buffer tensors (built on the
    meta device, then each module's tensors taken over from its twin: the structure does not depend on the plan)."""
    with torch.device("meta"):
        twin = type(model)(model.config, ops, plan).eval()
    mods, twins = dict(model.named_modules()), dict(twin.named_modules())
    if mods.keys() != twins.keys():
        raise SystemExit("decode_step_ab.py: the rebuilt model's modules differ from the loaded one's")
    for name, mod in mods.items():
        twins[name]._parameters.update(mod._parameters)
        twins[name]._buffers.update(mod._buffers)
    return twin


def _prime(graphs, runner, batch: int, context: int) -> None:
    """Static inputs of a realistic step: ``batch`` lanes, each ``context`` tokens in its own blocks."""
    bs = runner.block_size
    width = graphs.block_tables.shape[1]
    if context > width * bs:
        raise SystemExit(f"--context {context} exceeds the graph's {width * bs} tokens (raise --max-model-len)")
    dev = graphs.block_tables.device
    pos = context - 1
    for lane in range(batch):
        blocks = torch.arange(1 + lane * width, 1 + (lane + 1) * width, device=dev, dtype=graphs.block_tables.dtype)
        graphs.block_tables[lane, :width] = blocks
        graphs.input_ids[lane] = 1000 + lane
        graphs.positions[lane] = pos
        graphs.seq_lens[lane] = context
        graphs.slot_mapping[lane] = blocks[pos // bs] * bs + pos % bs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="benchmarks/configs/qwen3_30b_a3b.json")
    ap.add_argument("--settings", default="[{}]", help="JSON list of {env var: value}, or @file")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=200, help="tokens in each lane's KV cache")
    ap.add_argument("--max-model-len", type=int, default=256, help="the graph's max_seq_len (sets split-KV)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    settings = _settings(args.settings)
    if not torch.cuda.is_available():
        print("decode_step_ab.py needs a CUDA GPU (it times captured CUDA graphs)", file=sys.stderr)
        return 2

    from benchmarks.common import graph_replay_rounds
    from turnout import LLM, envs
    from turnout.worker.cuda_graphs import maybe_capture
    from turnout.entrypoints.bench_models import resolve_model
    from turnout.utils.roofline import copy_bandwidth, model_geometry

    llm = LLM(resolve_model(args.model)[0], load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_seqs=args.batch, gpu_memory_utilization=0.6)
    eng = llm.engine
    runner = eng.runner
    geo = model_geometry(runner.model, eng.hf_config, runner.dtype)
    step_bytes = geo.weight_bytes_per_step(args.batch) + args.batch * args.context * geo.kv_bytes_per_token
    copy_gb_s = copy_bandwidth(runner.device)  # GB/s
    base_env = dict(os.environ)
    from turnout.layers.fusion import plan_fusions
    from turnout.ops import resolve

    base_model = runner.model
    base_plan = base_model.plan
    possible = plan_fusions(runner.ops, rope_attention=True)  # what the op table allows
    fused_available, rope_available = possible.prenorm_linear, possible.rope_attention
    first = None
    rows = []
    for setting in settings:
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update({k: v for k, v in setting.items() if not k.startswith("model:")})
        envs.reload()  # turnout reads the environment once; the kernels see this setting from the next capture
        fused = setting.get("model:fused_prenorm", "1") != "0" and fused_available
        rope = setting.get("model:rope_attention", "1" if base_plan.rope_attention else "0") == "1" and rope_available
        plan = dataclasses.replace(base_plan, prenorm_linear=fused, prenorm_pays=possible.prenorm_pays if fused else None,
                                   rope_attention=rope)
        # the decode attention tiles are bound into the op table when it is resolved: a setting of them resolves a
        # table of its own and builds the model again over it
        attn_tiles = "TURNOUT_ATTN_DECODE" in setting
        ops = resolve(runner.ops.platform, runner.ops.policy) if attn_tiles else runner.ops
        runner.model = base_model if plan == base_plan and not attn_tiles else _rebuilt(base_model, ops, plan)
        runner.graphs = None
        gc.collect()
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        graphs = maybe_capture(runner)
        capture_s = time.perf_counter() - t0
        if graphs is None or args.batch not in graphs.graphs:
            raise SystemExit(f"no CUDA graph for batch {args.batch}: {graphs and graphs.disabled_reason}")
        graph = graphs.graphs[args.batch]
        with torch.inference_mode():
            _prime(graphs, runner, args.batch, args.context)
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        logits = graphs.logits[:args.batch].clone()
        repeats = []
        for _ in range(5):
            graph.replay()
            torch.cuda.synchronize()
            repeats.append(bool(torch.equal(graphs.logits[:args.batch], logits)))
        first = logits if first is None else first
        rounds = graph_replay_rounds(graph, args.reps)
        ms = min(rounds)
        gb_s = step_bytes / (ms * 1e-3) / 1e9
        row = {"setting": setting, "step_ms": round(ms, 4), "rounds_ms": [round(r, 4) for r in rounds],
               "GB_s": round(gb_s, 1), "frac_of_copy_bw": round(gb_s / copy_gb_s, 4),
               "replays_repeat": all(repeats), "logits_equal_first": bool(torch.equal(logits, first)),
               "max_abs_diff_first": float((logits - first).abs().max()), "capture_s": round(capture_s, 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del graph, graphs
        runner.graphs = None
    os.environ.clear()
    os.environ.update(base_env)
    envs.reload()
    runner.model = base_model
    summary = {"fused_prenorm_available": fused_available, "rope_attention_available": rope_available,
               "model": args.model, "batch": args.batch, "context": args.context, "gpu": torch.cuda.get_device_name(),
               "copy_GB_s": round(copy_gb_s, 1), "step_bytes": step_bytes, "results": rows}
    print(json.dumps(summary))
    base = rows[0]["step_ms"]
    print(f"\n{'ms/step':>8} {'vs first':>8} {'GB/s':>7} {'% copy':>7} {'repeat':>6}  setting")
    for r in rows:
        print(f"{r['step_ms']:8.4f} {100 * (r['step_ms'] / base - 1):+7.1f}% {r['GB_s']:7.0f} "
              f"{100 * r['frac_of_copy_bw']:6.1f}% {str(r['replays_repeat']):>6}  {json.dumps(r['setting'])}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if all(r["replays_repeat"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
