"""What each kernel of a captured batch-1 decode step costs where it runs: in the chain, beside its
neighbours (PDL), not alone.

    python benchmarks/decode_ablation.py [--model benchmarks/configs/qwen3_30b_a3b.json] \
        [--parts base,attention,o_proj,qkv,router,routing,gate_up,down,experts,lm_head,base]

Each part re-captures the step with that piece left out (its launch replaced by nothing, or the module
returning a buffer of the right shape) and times replays; the difference to ``base`` is the part's
marginal cost in the step. The outputs of an ablated step are garbage, by design: this tool measures time,
not results (decode_step_ab.py checks logits). Parts:

* ``attention``: the decode attention (``rotary_paged_attention``: its kernel and the split merge);
* ``o_proj`` / ``qkv``: those projections of every layer (the fused pre-norm goes with qkv);
* ``router``: the router projection and ``select_experts``; ``routing``: ``select_experts`` alone (fixed
  ids 0, 16, ..., distinct experts as a real routing has);
* ``gate_up`` / ``down``: one kernel of ``moe_experts``; ``experts``: both;
* ``lm_head``: the LM head.

Left out on purpose: the split merge alone. Without it the attention output is uninitialised memory, the
router sees NaN and every slot picks the same expert, which then hits in L2: the step gets faster for a
reason that is not the merge (seen on the H200: docs/benchmarks.md, "where the batch-1 MoE step goes"). Prints one
JSON line per part, then a table in µs per layer. Needs a CUDA GPU; MoE parts need an MoE model.
"""

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import graph_replay_rounds  # noqa: E402
from benchmarks.decode_step_ab import _prime  # noqa: E402

PARTS = ("base", "attention", "o_proj", "qkv", "router", "routing", "gate_up", "down", "experts", "lm_head")


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="benchmarks/configs/qwen3_30b_a3b.json")
    ap.add_argument("--parts", default=",".join(PARTS + ("base",)))
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; known: {list(PARTS)}")
    if not torch.cuda.is_available():
        print("decode_ablation.py needs a CUDA GPU (it times captured CUDA graphs)", file=sys.stderr)
        return 2

    import turnout.layers.moe.layer as moe_layer
    import turnout.ops.triton.moe_decode as moe_decode
    from turnout import LLM
    from turnout.entrypoints.bench_models import resolve_model
    from turnout.layers.moe.experts import FusedExperts
    from turnout.layers.moe.layer import Router
    from turnout.worker.cuda_graphs import maybe_capture

    llm = LLM(resolve_model(args.model)[0], load_format="dummy", dtype="bfloat16", max_model_len=256,
              max_num_seqs=1, gpu_memory_utilization=0.6)
    runner = llm.engine.runner
    model, dev, dtype = runner.model, runner.device, runner.dtype
    cfg = llm.engine.hf_config
    blocks = [m for m in model.modules() if hasattr(m, "rope_attention") and hasattr(m, "o_proj")]
    k = getattr(cfg, "num_experts_per_tok", 1)
    fixed = (torch.full((1, k), 1.0 / k, device=dev),
             (torch.arange(k, device=dev, dtype=torch.int32) * max(1, getattr(cfg, "num_experts", k) // k))[None])
    a = blocks[0]
    attn_out = torch.empty(1, a.num_heads, a.head_dim, device=dev, dtype=dtype)
    hidden = torch.empty(1, cfg.hidden_size, device=dev, dtype=dtype)
    qkv_out = torch.empty(1, a.qkv_proj.weight.shape[0], device=dev, dtype=dtype)
    logits = torch.empty(1, cfg.vocab_size, device=dev, dtype=torch.float32)
    saved = {"select": moe_layer.select_experts, "experts": FusedExperts.forward, "router": Router.forward,
             "down": moe_decode.one_token_down_kernel, "gate_up": moe_decode._decode_gate_up_kernel,
             "lm_head": model.lm_head.forward,
             "blocks": [(b.rope_attention, b.o_proj.forward, b.qkv_proj.forward) for b in blocks]}

    def restore():
        moe_layer.select_experts, FusedExperts.forward, Router.forward = (saved["select"], saved["experts"],
                                                                          saved["router"])
        moe_decode.one_token_down_kernel, moe_decode._decode_gate_up_kernel = saved["down"], saved["gate_up"]
        model.lm_head.forward = saved["lm_head"]
        for b, (ra, o, q) in zip(blocks, saved["blocks"]):
            b.rope_attention, b.o_proj.forward, b.qkv_proj.forward = ra, o, q

    def leave_out(part):
        restore()
        if part == "attention":
            for b in blocks:
                b.rope_attention = lambda *a, **kw: attn_out
        elif part == "o_proj":
            for b in blocks:
                b.o_proj.forward = lambda x: hidden
        elif part == "qkv":
            for b in blocks:
                b.qkv_proj.forward = lambda x: qkv_out
        elif part == "router":
            Router.forward = lambda self, x: fixed
        elif part == "routing":
            moe_layer.select_experts = lambda *a, **kw: fixed
        elif part == "gate_up":
            moe_decode._decode_gate_up_kernel = _NoLaunch()
        elif part == "down":
            moe_decode.one_token_down_kernel = _NoLaunch()
        elif part == "experts":
            FusedExperts.forward = lambda self, x, w, i: torch.empty_like(x)
        elif part == "lm_head":
            model.lm_head.forward = lambda *a, **kw: logits

    rows = []
    try:
        for part in parts:
            leave_out(part)
            runner.graphs = None
            gc.collect()
            torch.cuda.empty_cache()
            graphs = maybe_capture(runner)
            if graphs is None or 1 not in graphs.graphs:
                raise SystemExit(f"no CUDA graph for batch 1: {graphs and graphs.disabled_reason}")
            with torch.inference_mode():
                _prime(graphs, runner, 1, args.context)
            for _ in range(20):
                graphs.graphs[1].replay()
            torch.cuda.synchronize()
            ms = min(graph_replay_rounds(graphs.graphs[1], args.reps))
            rows.append({"part": part, "step_ms": round(ms, 4)})
            print(json.dumps(rows[-1]), flush=True)
            del graphs
            runner.graphs = None
    finally:
        restore()
    base = min(r["step_ms"] for r in rows if r["part"] == "base") if any(r["part"] == "base" for r in rows) else None
    layers = len(blocks)
    print(json.dumps({"model": args.model, "gpu": torch.cuda.get_device_name(), "layers": layers,
                      "context": args.context, "results": rows}))
    print(f"\n{'part left out':>14} {'ms/step':>8} {'us/layer saved':>15}")
    for r in rows:
        saved_us = "" if base is None else f"{1000 * (base - r['step_ms']) / layers:+15.2f}"
        print(f"{r['part']:>14} {r['step_ms']:8.4f} {saved_us}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
