"""The fp8 MoE expert kernels compile for an sm90 GPU on this machine, with no GPU (as tests/ops/test_compile_sm90.py
does for the decode-step kernels): the interpreter runs them as Python, so a construct the compiler rejects, a PDL
wait missing, or an fp8 dot that does not reach the fp8 matrix units would pass there and show only on the H200.
Each variant is compiled as moe_fp8 / moe_fp8_decode launch it (tests/quant/compile_sm90_fp8_moe.py, in a
subprocess because the session runs under the interpreter)."""

from pathlib import Path

from sm90_compile import require_compiler, run_script

require_compiler()

SCRIPT = Path(__file__).with_name("compile_sm90_fp8_moe.py")
EXPECTED = 16  # kernel variants the script compiles


def test_fp8_moe_kernels_compile_for_sm90():
    results = run_script(SCRIPT)
    assert len(results) == EXPECTED, [r["label"] for r in results]
    failed = {r["label"]: r.get("error") for r in results if not r["ok"]}
    assert not failed, failed
    assert all(r["sm90"] for r in results)
    assert not [r["label"] for r in results if r["pdl"] and not r["waits"]], "PDL on, but no griddepcontrol.wait"
    # 64 and 128 rows: Hopper's fp8 wgmma (fewer rows take mma.sync on the fp8 values converted to f16, exact)
    big = [r for r in results if (r["block_m"] or 0) >= 64]
    assert big and all(r["wgmma_e4m3"] for r in big), big
    assert all(r["shared"] <= 227 * 1024 for r in results)
