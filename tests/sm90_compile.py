"""Running a compile-for-sm90 script (tests/ops/compile_sm90_kernels.py, tests/quant/compile_sm90_fp8_moe.py) from a
test: it needs a Triton that can compile for CUDA here (PDL needs Triton >= 3.3) and the ptxas its wheel ships, and
runs in a subprocess without TRITON_INTERPRET (under the interpreter ``@triton.jit`` gives functions that cannot be
compiled). ``require_compiler()`` skips the calling module where that is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def require_compiler() -> None:
    pytest.importorskip("triton")
    try:
        import triton.backends.nvidia as nv
        from triton.language.extra.cuda import gdc_wait  # noqa: F401 - PDL needs Triton >= 3.3
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"this Triton cannot compile for CUDA here: {e}", allow_module_level=True)
    if not os.path.exists(os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")):
        pytest.skip("the Triton wheel has no ptxas", allow_module_level=True)


def run_script(script: Path) -> list[dict]:
    """The script's JSON lines (one per kernel variant); asserts it exited 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
