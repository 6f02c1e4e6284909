#!/usr/bin/env bash
# turnout's FlagGems plugin on one GPU, in one call (at most 10 minutes: each step has its own timeout, so a slow
# one costs only itself): the carried wheels and the plugin installed with --no-deps into /tmp/flaggems-site,
# then `turnout ops` and `turnout ops --check` for every op the plugin serves, then benchmarks/flaggems_ops.py
# (sample cases served / sent on, per-op timings, greedy tokens and the decode step with FlagGems preferred).
#
#   benchmarks/flaggems_ops.sh WHEELS_DIR
#
# WHEELS_DIR holds, for Python 3.12 on manylinux x86_64 (pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 <name>==<version>):
#   flag_gems-5.0.2-py3-none-any.whl
#   sqlalchemy-2.0.48-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
#   greenlet-3.5.6-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
# (FlagGems' other import-time needs, PyYAML, packaging, numpy and typing-extensions, come with torch and
# transformers.) Results: $OUT/flaggems/*.txt|json.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${1:?usage: benchmarks/flaggems_ops.sh WHEELS_DIR}
out=${OUT:-/tmp}/flaggems
site=${TMPDIR:-/tmp}/flaggems-site  # not under $OUT: only the results come back
mkdir -p "$out"
python -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" "$wheels"/*.whl \
  ./plugins/turnout-flaggems || exit 1
export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH}
ops=$(python -c 'from turnout_flaggems import OPS; print(",".join(OPS))')
python -c 'import flag_gems, sys; print("flag_gems", flag_gems.__version__, "on", flag_gems.vendor_name)' 2>&1 | tail -3
timeout 60 python -m turnout.entrypoints.cli ops --op "$ops" > "$out/ops.txt" 2>&1
grep -A3 -E '^[a-z_0-9]+  ->' "$out/ops.txt" | grep -E '  ->  |flaggems' | head -40
# only FlagGems is checked (turnout's own kernels have their conformance runs); the cases it sends on go to the reference
TURNOUT_OPS="deny=triton,vendor.cuda" timeout 150 python -m turnout.entrypoints.cli ops --check --json --op "$ops" \
  > "$out/check.json" 2> "$out/check.err"
python - "$out/check.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no conformance JSON: {e}")
for r in rows:
    if r["impl"] == "vendor.flaggems":
        print(f'{r["op"]:22} {r["impl"]:16} {"PASS" if r["passed"] else "FAIL"} cases {r["cases"]} failed {r["failed"]} '
              f'skipped {r.get("skipped", 0)} max_error {r.get("max_error")}')
PY
timeout 160 python benchmarks/flaggems_ops.py --parts cases,timings --output-json "$out/ops.json" 2>&1 \
  | grep -v '^JSON ' | tail -60
timeout 210 python benchmarks/flaggems_ops.py --parts tokens --output-json "$out/tokens.json" 2>&1 \
  | grep -v '^JSON ' | tail -15
