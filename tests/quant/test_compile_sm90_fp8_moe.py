"""The fp8 MoE expert kernels compile for an sm90 GPU on this machine, with no GPU (as tests/ops/test_compile_sm90.py
does for the decode-step kernels): the interpreter runs them as Python, so a construct the compiler rejects, a PDL
wait missing, or an fp8 dot that does not reach the fp8 matrix units would pass there and show only on the H200.
Each variant is compiled as moe_fp8 / moe_fp8_decode launch it (tests/quant/compile_sm90_fp8_moe.py, in a
subprocess because the session runs under the interpreter)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

try:
    import triton.backends.nvidia as _nv
    from triton.language.extra.cuda import gdc_wait  # noqa: F401 - PDL needs Triton >= 3.3
except ImportError as e:  # pragma: no cover
    pytest.skip(f"this Triton cannot compile for CUDA here: {e}", allow_module_level=True)

if not os.path.exists(os.path.join(os.path.dirname(_nv.__file__), "bin", "ptxas")):
    pytest.skip("the Triton wheel has no ptxas", allow_module_level=True)

SCRIPT = Path(__file__).with_name("compile_sm90_fp8_moe.py")
EXPECTED = 13  # kernel variants the script compiles


def test_fp8_moe_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == EXPECTED, [r["label"] for r in results]
    failed = {r["label"]: r.get("error") for r in results if not r["ok"]}
    assert not failed, failed
    assert all(r["sm90"] for r in results)
    assert not [r["label"] for r in results if r["pdl"] and not r["waits"]], "PDL on, but no griddepcontrol.wait"
    # 64 and 128 rows: Hopper's fp8 wgmma (fewer rows take mma.sync on the fp8 values converted to f16, exact)
    big = [r for r in results if (r["block_m"] or 0) >= 64]
    assert big and all(r["wgmma_e4m3"] for r in big), big
    assert all(r["shared"] <= 227 * 1024 for r in results)
