"""The decode-step Triton kernels compile for an sm90 GPU, on this machine, with no GPU.

CI has no GPU and runs the kernels under the interpreter, which executes them as Python: a construct the
compiler rejects (or a programmatic-dependent-launch intrinsic in the wrong place) would pass there and
fail only on a GPU. ``triton.compile`` with a CUDA target lowers each kernel to PTX and runs the ptxas that
ships in the Triton wheel, without a driver. Each kernel is compiled as the H200 runs it (PDL on, bf16),
in each branch its constexprs select (tests/ops/compile_sm90_kernels.py, run in a subprocess because the
test session runs under the interpreter)."""

from pathlib import Path

import pytest

from sm90_compile import require_compiler, run_script

require_compiler()

SCRIPT = Path(__file__).with_name("compile_sm90_kernels.py")
EXPECTED = 42  # kernel variants the script compiles


@pytest.fixture(scope="module")
def results():
    return run_script(SCRIPT)


def test_every_decode_kernel_compiles_for_sm90_with_pdl(results):
    assert len(results) == EXPECTED, [r["label"] for r in results]
    failed = {r["label"]: r.get("error") for r in results if not r["ok"]}
    assert not failed, failed
    assert all(r["sm90"] for r in results)
    missing = [r["label"] for r in results if r["pdl"] and not r["waits"]]
    assert not missing, f"PDL on, but no griddepcontrol.wait in: {missing}"
