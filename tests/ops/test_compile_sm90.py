"""The decode-step Triton kernels compile for an sm90 GPU, on this machine, with no GPU.

CI has no GPU and runs the kernels under the interpreter, which executes them as Python: a construct the
compiler rejects (or a programmatic-dependent-launch intrinsic in the wrong place) would pass there and
fail only on a GPU. ``triton.compile`` with a CUDA target lowers each kernel to PTX and runs the ptxas that
ships in the Triton wheel, without a driver. Each kernel is compiled as the H200 runs it (PDL on, bf16),
in each branch its constexprs select (tests/ops/compile_sm90_kernels.py, run in a subprocess because the
test session runs under the interpreter)."""

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

SCRIPT = Path(__file__).with_name("compile_sm90_kernels.py")
EXPECTED = 35  # kernel variants the script compiles


@pytest.fixture(scope="module")
def results():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_decode_kernel_compiles_for_sm90_with_pdl(results):
    assert len(results) == EXPECTED, [r["label"] for r in results]
    failed = {r["label"]: r.get("error") for r in results if not r["ok"]}
    assert not failed, failed
    assert all(r["sm90"] for r in results)
    missing = [r["label"] for r in results if r["pdl"] and not r["waits"]]
    assert not missing, f"PDL on, but no griddepcontrol.wait in: {missing}"
