"""The MLA Triton kernels compile for an sm90 GPU at DeepSeek-V3's attention shape (latent 512 + 64), with no GPU:
bf16 and fp8 latent caches, one split and several, prefill programs of two tokens, PDL on (tests/ops/compile_sm90_mla.py, in a subprocess)."""

from pathlib import Path

from sm90_compile import require_compiler, run_script

require_compiler()


def test_mla_kernels_compile_for_sm90_with_pdl():
    results = run_script(Path(__file__).with_name("compile_sm90_mla.py"))
    assert len(results) == 8, [r["label"] for r in results]
    failed = {r["label"]: r.get("error") for r in results if not r["ok"]}
    assert not failed, failed
    assert all(r["sm90"] and r["waits"] for r in results)
