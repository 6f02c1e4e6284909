#!/usr/bin/env bash
# Multi-GPU checks in one call on a machine with several GPUs (nvidia-h200-x2 or -x4): correctness of TP / EP on
# NCCL against one rank, then speed, each step under `timeout`, one JSON summary (OUTDIR/summary.json).
#
#   benchmarks/multigpu_suite.sh OUTDIR            # TP=2 (TP=${TP:-2})
#   SMOKE=1 benchmarks/multigpu_suite.sh OUTDIR    # on a CPU over gloo: tiny models, short runs (checks the script)
#
# Steps (caps in seconds; SKIP="a b" skips steps):
#   tp_check     benchmarks/tp_check.py: tiny random fp32 models (Llama with 1 kv head, Qwen3, Qwen3-MoE, EP)
#                greedy identical + logprobs within 1e-5; Qwen3-8B dummy bf16 TP=2 vs TP=1            180
#   allreduce    benchmarks/allreduce.py under torchrun: decode (1 x hidden) latency, prefill bandwidth,
#                beside a copy                                                                          60
#   lat_tp1 / lat_tp2   Qwen3-8B batch-1 decode, TP=1 then TP=2 (target 1.6x, >= 380 tok/s)               70 each
#   thr_tp2      Qwen3-8B 512 x (1024 in / 512 out), TP=2                                               120
#   llama70b_b1  Llama-3.1-70B dummy bf16 TP=2 batch 1 (target >= 70 % of the summed copy bandwidth)     150
#   llama70b_thr Llama-3.1-70B TP=2, 256 x (1024 in / 256 out)                                           150
#   moe_*        Qwen3-30B-A3B batch 1 and 64: TP=1, TP=2, EP=2                                          60 each
# NVLink multicast stays off (the machines' own rule): NCCL_NVLS_ENABLE=0 and the other variables below.
set -u
OUT=${1:?usage: benchmarks/multigpu_suite.sh OUTDIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}; TP=${TP:-2}; STEPS="$OUT/steps.jsonl"; : >"$STEPS"
BENCH=("$PY" -m turnout.entrypoints.bench_cmd --log-level WARNING)
DEV=(); DT=bfloat16; B1_IN=128 B1_OUT=256 THR_N=512 THR_IN=1024 THR_OUT=512 L_N=256 L_OUT=256 MOE_B=64 MOE_LEN=128
DENSE=qwen3-8b BIG=llama-3.1-70b MOE=benchmarks/configs/qwen3_30b_a3b.json LARGE=(--large qwen3-8b)
if [[ "${SMOKE:-0}" == 1 ]]; then
  DEV=(--device cpu); DT=float32; B1_IN=8 B1_OUT=4 THR_N=4 THR_IN=8 THR_OUT=4 L_N=2 L_OUT=4 MOE_B=2 MOE_LEN=8
  DENSE=qwen3-0.6b BIG=qwen3-0.6b LARGE=(--skip-large); export OMP_NUM_THREADS=1
fi

step() {  # step NAME CAP CMD...: stdout+stderr to OUTDIR/NAME.log, a line in steps.jsonl
  local name=$1 cap=$2; shift 2
  if [[ " ${SKIP:-} " == *" $name "* ]]; then echo "{\"step\":\"$name\",\"status\":\"skipped\"}" >>"$STEPS"; return; fi
  echo "[multigpu] $(date +%T) $name (cap ${cap}s)" >&2
  local t0=$(date +%s); timeout -k 5 "$cap" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "{\"step\":\"$name\",\"status\":\"$([[ $rc == 0 ]] && echo ok || echo failed)\",\"rc\":$rc,\"seconds\":$(($(date +%s) - t0))}" >>"$STEPS"
}
lat() {  # lat NAME CAP MODEL BATCH IN OUT EXTRA...
  local name=$1 cap=$2 model=$3 b=$4 in=$5 out=$6; shift 6
  step "$name" "$cap" "${BENCH[@]}" latency --model "$model" --load-format dummy --dtype "$DT" ${DEV[@]+"${DEV[@]}"} \
    --batch-size "$b" --input-len "$in" --output-len "$out" --num-iters 2 --output-json "$OUT/$name.json" "$@"
}

step tp_check 180 "$PY" benchmarks/tp_check.py --tp "$TP" ${DEV[@]+"${DEV[@]}"} "${LARGE[@]}" --json "$OUT/tp_check.json"
if [[ "${SMOKE:-0}" == 1 ]]; then AR=(--device cpu --sizes 1,8); else AR=(--hidden 4096); fi
step allreduce 60 "$PY" -m torch.distributed.run --nproc-per-node "$TP" benchmarks/allreduce.py "${AR[@]}" --json "$OUT/allreduce.json"
lat lat_tp1 70 "$DENSE" 1 "$B1_IN" "$B1_OUT"
lat lat_tp2 70 "$DENSE" 1 "$B1_IN" "$B1_OUT" -tp "$TP"
step thr_tp2 120 "${BENCH[@]}" throughput --model "$DENSE" --load-format dummy --dtype "$DT" ${DEV[@]+"${DEV[@]}"} -tp "$TP" \
  --num-prompts "$THR_N" --input-len "$THR_IN" --output-len "$THR_OUT" --output-json "$OUT/thr_tp2.json"
lat llama70b_b1 150 "$BIG" 1 "$B1_IN" "$B1_OUT" -tp "$TP"
step llama70b_thr 150 "${BENCH[@]}" throughput --model "$BIG" --load-format dummy --dtype "$DT" ${DEV[@]+"${DEV[@]}"} -tp "$TP" \
  --num-prompts "$L_N" --input-len "$THR_IN" --output-len "$L_OUT" --output-json "$OUT/llama70b_thr.json"
if [[ "${SMOKE:-0}" != 1 ]]; then
  for b in 1 "$MOE_B"; do
    lat moe_tp1_b$b 60 "$MOE" "$b" "$MOE_LEN" "$MOE_LEN"
    lat moe_tp2_b$b 60 "$MOE" "$b" "$MOE_LEN" "$MOE_LEN" -tp "$TP"
    lat moe_ep2_b$b 60 "$MOE" "$b" "$MOE_LEN" "$MOE_LEN" -tp "$TP" --enable-expert-parallel
  done
fi

"$PY" - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
summary = {"steps": [json.loads(l) for l in open(os.path.join(out, "steps.jsonl")) if l.strip()]}
for f in sorted(glob.glob(os.path.join(out, "*.json"))):
    name = os.path.basename(f)[:-5]
    if name == "summary":
        continue
    try:
        summary[name] = json.load(open(f))
    except Exception as e:  # noqa: BLE001 - a step cut short leaves a partial file
        summary[name] = {"unreadable": repr(e)}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(summary["steps"]))
PY
