#!/usr/bin/env bash
# The GPU suite in two parts, each one device call of under 9 minutes on a cold machine (a cold Triton cache
# compiles every kernel on first use), and one JSON summary per call.
#
#   benchmarks/gpu_suite.sh OUTDIR tests     GPU tests, conformance suite, kernel micro-benchmarks
#   benchmarks/gpu_suite.sh OUTDIR bench     every benchmark with its HF peer (dense, then MoE)
#   benchmarks/gpu_suite.sh OUTDIR [all]     both in one call: only on a warm machine (QUICK=1 advised)
#
# Steps, in order, each under `timeout` (its cap, or what is left of the part's budget). In each part
# the caps add up to no more than the budget, so no step is skipped for lack of time: a slow step is cut
# at its cap (timed_out) and the next one runs. docs/gpu.md has the measured time of each part.
#   tests:
#   pytest_gpu     python -m pytest -m gpu tests/ (engine group)  -> pytest_gpu.xml      cap PYTEST_CAP (300 s)
#   and at the same time, one after another:
#   pytest_gpu_kernels  the op-level GPU tests of tests/ops       -> pytest_gpu_kernels.xml  cap PYTEST_CAP
#   pytest_gpu_kernels2 (at the same time) the MoE / quant / bitmask ones -> pytest_gpu_kernels2.xml
#   ops_check      turnout ops --check --json (conformance)  -> ops_check.json           cap 150 s
#   then, alone:
#   kernels        python benchmarks/op_kernels.py              -> kernels.log (JSON lines)  cap 50 s
#   bench:
#   lat_graphs     turnout bench latency, Qwen3-8B dummy bf16, batch 1, 128 in / 256 out, CUDA graphs  60 s
#   lat_eager      the same with --enforce-eager                                                       35 s
#   throughput     turnout bench throughput, 512 x (1024 in / 512 out)   (QUICK=1: 128 prompts)       90 s
#   prefill        turnout bench latency, 8 x 2048 in / 1 out: prefill TFLOP/s                         35 s
#   hf_peer        HF transformers on identical weights: batch-1 eager/static, throughput, greedy     100 s
#   moe_b1         turnout bench latency, MOE_MODEL (Qwen3-30B-A3B dummy) batch 1, 128 in / 128 out     55 s
#   moe_b64        the same at batch 64 (the target: >= 10x HF)                                        55 s
#   hf_moe         HF on identical MoE weights: batch-1 eager, and one batch of 64 x (128 in / 128 out) 100 s
# A peer runs in the same part as the benchmarks it is compared with, so each call's summary has its
# ratios. After every step OUTDIR/summary.json is rewritten (benchmarks/gpu_suite_summary.py; it reads
# the steps of every part found in OUTDIR), so a run cut short still leaves a summary.
#
# Environment: SUITE_BUDGET_S (default 540 a call), MODEL (default qwen3-8b), PYTHON (default python),
# MOE_MODEL (default benchmarks/configs/qwen3_30b_a3b.json; MOE_MODEL=none skips the MoE steps),
# QUICK=1, COMPILE=1 (also HF static cache + torch.compile, last), SKIP="step step" to skip steps,
# PYTEST_CAP (default 300), SMOKE=1 (tiny lengths and float32: checks the script itself on a CPU, with
# MODEL=a tiny config).
set -u
OUT=${1:?usage: benchmarks/gpu_suite.sh OUTDIR [tests|bench|all]}
PART=${2:-all}
case "$PART" in tests | bench | all) ;; *)
  echo "benchmarks/gpu_suite.sh: unknown part '$PART' (tests, bench or all)" >&2
  exit 2
  ;;
esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
MODEL=${MODEL:-qwen3-8b}
QUICK=${QUICK:-0}
DTYPE=${DTYPE:-bfloat16}
LAT_IN=128 LAT_OUT=256 THR_IN=1024 THR_OUT=512 PF_BATCH=8 PF_IN=2048 CMP_TOKENS=32
MOE_MODEL=${MOE_MODEL:-benchmarks/configs/qwen3_30b_a3b.json}
MOE_IN=128 MOE_OUT=128 MOE_BATCH=64
if [[ "${SMOKE:-0}" == 1 ]]; then
  MOE_IN=8 MOE_OUT=4 MOE_BATCH=4
  DTYPE=float32 LAT_IN=8 LAT_OUT=4 THR_IN=8 THR_OUT=4 PF_BATCH=2 PF_IN=16 CMP_TOKENS=4 NUM_PROMPTS=${NUM_PROMPTS:-4}
fi
BUDGET=${SUITE_BUDGET_S:-540}
RESERVE=8 # seconds kept for the last summary
START=$(date +%s)
STEPS="$OUT/steps_$PART.jsonl"
: >"$STEPS"

summarize() { "$PY" benchmarks/gpu_suite_summary.py "$OUT" >/dev/null 2>>"$OUT/summary.log" || true; }

source benchmarks/suite_steps.sh

"$PY" - >"$OUT/env.json" 2>"$OUT/env.log" <<'EOF' || true
import json, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
try:
    import triton; info["triton"] = triton.__version__
except Exception as e: info["triton"] = repr(e)
try:
    import transformers; info["transformers"] = transformers.__version__
except Exception as e: info["transformers"] = repr(e)
try:
    import pytest_timeout; info["pytest_timeout"] = True
except Exception: info["pytest_timeout"] = False
print(json.dumps(info))
EOF

# The GPU tests in three groups that run at once on the one GPU (a cold Triton cache makes the suite compile-bound,
# and compiling is CPU work; cold on an H100, tests/ops and the MoE / quant tests in one process were not done
# in 540 s): two kernel groups (op-level tests that build no engine, so they size no KV cache from the free
# memory) and, beside them, the engine group (everything else). The kernel group's chain then runs
# the conformance suite, which also builds no engine; the kernel timings run last, alone on the GPU.
# GPU_TESTS_SERIAL=1: one process.
KERNEL_TESTS=(tests/ops)  # op-level group 1 (its chain then runs the conformance suite)
KERNEL_TESTS_2=(tests/moe/test_moe_decode.py tests/moe/test_moe_backends.py tests/quant/test_fp8_gpu.py
  tests/quant/test_w4_gpu.py tests/quant/test_w4_moe_gpu.py tests/quant/test_fp8_moe_gpu.py
  tests/structured/test_bitmask_stage.py)  # op-level group 2

tests_part() {
  # Server tests need fastapi; their collection errors must not stop the rest.
  PT_ARGS=(-q -m gpu --maxfail=30 --continue-on-collection-errors -p no:cacheprovider --durations=25)
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then PT_ARGS+=(--timeout 150); fi
  local cap=${PYTEST_CAP:-300}
  if [[ "${GPU_TESTS_SERIAL:-0}" == 1 ]]; then
    step pytest_gpu "$cap" "$PY" -m pytest "${PT_ARGS[@]}" tests/ --junitxml="$OUT/pytest_gpu.xml"
    kernel_chain
    kernel_timings
    return
  fi
  local ignore=() f
  for f in "${KERNEL_TESTS[@]}" "${KERNEL_TESTS_2[@]}"; do ignore+=("--ignore=$f"); done
  (
    step pytest_gpu_kernels "$cap" "$PY" -m pytest "${PT_ARGS[@]}" "${KERNEL_TESTS[@]}" \
      --junitxml="$OUT/pytest_gpu_kernels.xml"
    kernel_chain
  ) &
  local chain=$!
  step pytest_gpu_kernels2 "$cap" "$PY" -m pytest "${PT_ARGS[@]}" "${KERNEL_TESTS_2[@]}" \
    --junitxml="$OUT/pytest_gpu_kernels2.xml" &
  local chain2=$!
  step pytest_gpu "$cap" "$PY" -m pytest "${PT_ARGS[@]}" tests/ "${ignore[@]}" --junitxml="$OUT/pytest_gpu.xml"
  wait "$chain" "$chain2"
  kernel_timings
}

kernel_chain() {
  # Conformance suite on CUDA (JSON on stdout).
  step ops_check 150 bash -c "exec \"$PY\" -m turnout.entrypoints.cli ops --check --json >\"$OUT/ops_check.json\""
}

kernel_timings() {
  # Kernel micro-benchmarks, alone on the GPU (after both test groups: timings beside other work mean nothing).
  if [[ -f benchmarks/op_kernels.py ]]; then
    # KERNELS_ARGS replaces the defaults (the PyTorch reference peer is slow: skipped unless asked for).
    step kernels 50 "$PY" benchmarks/op_kernels.py ${KERNELS_ARGS:---no-reference --json "$OUT/kernels.json"}
  else
    printf '{"step":"kernels","status":"skipped","reason":"benchmarks/op_kernels.py not found"}\n' >>"$STEPS"
  fi
}

bench_part() {
  BENCH=("$PY" -m turnout.entrypoints.bench_cmd --log-level INFO)
  # 4-5. Batch-1 latency, graphs on then off.
  step lat_graphs 60 "${BENCH[@]}" latency --model "$MODEL" --load-format dummy --dtype "$DTYPE" \
    --batch-size 1 --input-len "$LAT_IN" --output-len "$LAT_OUT" --num-iters 3 --output-json "$OUT/lat_graphs.json"
  step lat_eager 35 "${BENCH[@]}" latency --model "$MODEL" --load-format dummy --dtype "$DTYPE" \
    --batch-size 1 --input-len "$LAT_IN" --output-len "$LAT_OUT" --num-iters 2 --enforce-eager --output-json "$OUT/lat_eager.json"

  # 6. Offline throughput.
  if [[ "$QUICK" == 1 ]]; then NUM_PROMPTS=${NUM_PROMPTS:-128}; else NUM_PROMPTS=${NUM_PROMPTS:-512}; fi
  step throughput 90 "${BENCH[@]}" throughput --model "$MODEL" --load-format dummy --dtype "$DTYPE" \
    --num-prompts "$NUM_PROMPTS" --input-len "$THR_IN" --output-len "$THR_OUT" --max-num-seqs 256 \
    --max-num-batched-tokens 16384 --output-json "$OUT/throughput.json"

  # 7. Prefill of 8 x 2048 tokens in one step.
  step prefill 35 "${BENCH[@]}" latency --model "$MODEL" --load-format dummy --dtype "$DTYPE" \
    --batch-size "$PF_BATCH" --input-len "$PF_IN" --output-len 1 --num-iters 3 --max-num-batched-tokens 16384 \
    --output-json "$OUT/prefill.json"

  # 8. The HF peer on identical weights (at most 100 s).
  if [[ "$QUICK" == 1 ]]; then HF_BATCH=${HF_BATCH:-32}; else HF_BATCH=${HF_BATCH:-128}; fi
  step hf_peer 100 "$PY" benchmarks/hf_peer.py --model "$MODEL" --dtype "$DTYPE" --input-len "$LAT_IN" --output-len "$LAT_OUT" \
    --thr-num-prompts "$NUM_PROMPTS" --thr-input-len "$THR_IN" --thr-output-len "$THR_OUT" --max-batch "$HF_BATCH" \
    --compare-turnout "$CMP_TOKENS" $([[ "${COMPILE:-0}" == 1 ]] && echo --compile) --output-json "$OUT/hf_peer.json"

  # 9-11. MoE: batch 1 and batch 64 decode, then the HF peer on identical weights.
  if [[ "$MOE_MODEL" != none ]]; then
    step moe_b1 55 "${BENCH[@]}" latency --model "$MOE_MODEL" --load-format dummy --dtype "$DTYPE" \
      --batch-size 1 --input-len "$MOE_IN" --output-len "$MOE_OUT" --num-iters 3 --output-json "$OUT/moe_b1.json"
    step moe_b64 55 "${BENCH[@]}" latency --model "$MOE_MODEL" --load-format dummy --dtype "$DTYPE" \
      --batch-size "$MOE_BATCH" --input-len "$MOE_IN" --output-len "$MOE_OUT" --num-iters 2 --output-json "$OUT/moe_b64.json"
    step hf_moe 100 "$PY" benchmarks/hf_peer.py --model "$MOE_MODEL" --dtype "$DTYPE" --modes eager \
      --input-len "$MOE_IN" --output-len "$MOE_OUT" --thr-num-prompts "$MOE_BATCH" --thr-input-len "$MOE_IN" \
      --thr-output-len "$MOE_OUT" --max-batch "$MOE_BATCH" --output-json "$OUT/hf_moe.json"
  fi
}

echo "[gpu_suite] part $PART, budget ${BUDGET}s" >&2
if [[ "$PART" == tests || "$PART" == all ]]; then tests_part; fi
if [[ "$PART" == bench || "$PART" == all ]]; then bench_part; fi

summarize
echo "[gpu_suite] $PART done in $(($(date +%s) - START))s: $OUT/summary.json" >&2
cat "$OUT/summary.json" 2>/dev/null | head -c 20000
