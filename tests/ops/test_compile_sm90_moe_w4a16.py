"""The moe_experts_w4a16 Triton kernels compile for an sm90 GPU on this machine, with no GPU (the interpreter runs them
as Python, which accepts constructs the compiler rejects): tests/ops/compile_sm90_moe_w4a16.py in a subprocess."""

from pathlib import Path

from sm90_compile import require_compiler, run_script

require_compiler()


def test_moe_w4a16_kernels_compile_for_sm90():
    results = run_script(Path(__file__).with_name("compile_sm90_moe_w4a16.py"))
    assert len(results) == 6, [r["label"] for r in results]
    failed = {r["label"]: r.get("error") for r in results if not r["ok"]}
    assert not failed, failed
    assert all(r["sm90"] for r in results)
