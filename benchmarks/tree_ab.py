"""One A/B process (benchmarks/tree_ab.sh): greedy tokens, batch-1 and batch-64 decode ms/step of the turnout tree on PYTHONPATH, dummy bf16 weights. Same-run comparison of two trees; the peer and ceilings are in gpu_suite.sh."""
import json
import sys
import time

from turnout import LLM, SamplingParams
from turnout.entrypoints.bench_models import resolve_model

name, out = sys.argv[1], sys.argv[2]
t0 = time.time()
llm = LLM(resolve_model(name)[0], load_format="dummy", dtype="bfloat16", seed=0, max_model_len=512, max_num_seqs=64)
load_s = time.time() - t0
greedy = SamplingParams(temperature=0, max_tokens=32)
prompts = [[(17 * i + 3 * j) % 5000 + 10 for j in range(24 + 5 * i)] for i in range(4)]
batch4 = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
batch1 = llm.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
long = [[(7 * j) % 5000 + 10 for j in range(int(__import__("os").environ.get("AB_PROMPT", "128")))]]
steps = []
for _ in range(3):
    o = llm.generate(long, SamplingParams(temperature=0, max_tokens=int(__import__("os").environ.get("AB_TOKENS", "256")), ignore_eos=True), use_tqdm=False)[0]
    m = o.metrics
    steps.append((m.last_token_time - m.first_token_time) / (len(o.outputs[0].token_ids) - 1) * 1e3)
# batch 64: every request decodes in the same steps, so one request's decode span over its tokens is the step time
wide = [[(11 * i + 7 * j) % 5000 + 10 for j in range(128)] for i in range(64)]
steps64 = []
for _ in range(3):
    outs = llm.generate(wide, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    spans = sorted((o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1) * 1e3
                   for o in outs)
    steps64.append(spans[len(spans) // 2])
res = {"model": name, "load_s": round(load_s, 1), "ms_per_step": [round(s, 4) for s in steps],
       "best_ms": round(min(steps), 4), "ms_per_step_b64": [round(s, 4) for s in steps64],
       "best_ms_b64": round(min(steps64), 4), "batch4": batch4, "batch1": batch1}
json.dump(res, open(out, "w"))
print(json.dumps({k: v for k, v in res.items() if k not in ("batch4", "batch1")}))
