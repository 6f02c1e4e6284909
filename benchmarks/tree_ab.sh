#!/usr/bin/env bash
# A/B on the GPU: a baseline tree ($BASE/turnout, e.g. a git worktree of an older commit) against this one; one
# process per (tree, model), interleaved base/new/base/new; greedy tokens and batch-1 decode ms/step.
set -u
OUT=${1:?usage: BASE=dir-with-old-turnout benchmarks/tree_ab.sh OUTDIR}; ROOT=$PWD; BASE=${BASE:?BASE: a directory holding the baseline turnout/ package}; mkdir -p $OUT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for m in ${MODELS:-benchmarks/configs/qwen3_30b_a3b.json qwen3-8b}; do
  t=$(basename $m .json)
  for r in $(seq 1 ${RUNS:-2}); do
    for tree in base new; do
      p=$ROOT; [[ $tree == base ]] && p=$BASE
      if (( SECONDS > ${DEADLINE:-470} )); then echo "skip $t $tree $r: ${SECONDS}s"; continue; fi
      echo "== $t $tree $r $(date +%T)"
      PYTHONPATH=$p timeout ${CAP:-150} python3 benchmarks/tree_ab.py $m $OUT/ab_${t}_${tree}_$r.json 2>$OUT/ab_${t}_${tree}_$r.err | tail -1
    done
  done
  python3 - $OUT $t <<'PY'
import json, sys, glob
o, t = sys.argv[1], sys.argv[2]
r = {f.split("/")[-1]: json.load(open(f)) for f in sorted(glob.glob(f"{o}/ab_{t}_*.json"))}
toks = {k: (v["batch4"], v["batch1"]) for k, v in r.items()}
print(t, "greedy identical across trees and runs:", len({json.dumps(v) for v in toks.values()}) == 1, "runs:", len(r))
print(t, "batch 1 ms/step", {k: v["best_ms"] for k, v in r.items()})
print(t, "batch 64 ms/step", {k: v.get("best_ms_b64") for k, v in r.items()})
PY
done
