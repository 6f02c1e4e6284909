# Sourced by the GPU suites (benchmarks/gpu_suite.sh, benchmarks/issue_suite.sh): one timed step of a device
# call. Needs OUT, STEPS (a JSON-lines file), BUDGET, START, RESERVE, and a function `summarize` (may do nothing).
# A step runs under min(its cap, what is left of the budget), so a slow step costs only itself.
# step NAME CAP_S CMD... : run CMD with stdout+stderr to OUTDIR/NAME.log under min(CAP, budget left).
step() {
  local name=$1 cap=$2
  shift 2
  local now left limit t0 rc timed_out
  now=$(date +%s)
  left=$((BUDGET - (now - START) - RESERVE))
  limit=$((cap < left ? cap : left))
  if [[ " ${SKIP:-} " == *" $name "* ]]; then
    printf '{"step":"%s","status":"skipped","reason":"SKIP"}\n' "$name" >>"$STEPS"
    return
  fi
  if ((limit < 15)); then
    printf '{"step":"%s","status":"skipped","reason":"no time left (%ss)"}\n' "$name" "$left" >>"$STEPS"
    summarize
    return
  fi
  echo "[gpu_suite] $(date +%T) $name (limit ${limit}s): $*" >&2
  t0=$(date +%s%N)
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  ms=$((($(date +%s%N) - t0) / 1000000))
  timed_out=false
  if ((rc == 124 || rc == 137)); then timed_out=true; fi
  printf '{"step":"%s","status":"%s","rc":%d,"timed_out":%s,"limit_s":%d,"seconds":%d.%03d,"log":"%s.log"}\n' \
    "$name" "$([[ $rc == 0 ]] && echo ok || echo failed)" "$rc" "$timed_out" "$limit" \
    $((ms / 1000)) $((ms % 1000)) "$name" >>"$STEPS"
  echo "[gpu_suite] $name rc=$rc" >&2
  summarize
}

