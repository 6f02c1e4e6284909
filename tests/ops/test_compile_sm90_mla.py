"""The MLA Triton kernels compile for an sm90 GPU at DeepSeek-V3's attention shape (latent 512 + 64), with no GPU:
bf16 and fp8 latent caches, one split and several, prefill programs of two tokens, PDL on (tests/ops/compile_sm90_mla.py, in a subprocess);
the decompressed prefill's gather and varlen attention (tests/ops/compile_sm90_mla_prefill.py)."""

from pathlib import Path

from sm90_compile import require_compiler, run_script

require_compiler()


def test_mla_kernels_compile_for_sm90_with_pdl():
    results = run_script(Path(__file__).with_name("compile_sm90_mla.py"))
    assert len(results) == 8, [r["label"] for r in results]
    failed = {r["label"]: r.get("error") for r in results if not r["ok"]}
    assert not failed, failed
    assert all(r["sm90"] and r["waits"] for r in results)


def test_decompressed_prefill_kernels_compile_for_sm90():
    """The gather (bf16 and fp8 latent cache, 512 + 64) and the varlen attention (keys 128 + 64, values 128, both
    query tiles the wrapper picks) compile to sm90 cubins, within an H100's shared memory."""
    results = run_script(Path(__file__).with_name("compile_sm90_mla_prefill.py"))
    assert len(results) == 4, [r["label"] for r in results]
    failed = {r["label"]: r.get("error") for r in results if not r["ok"]}
    assert not failed, failed
    assert all(r["sm90"] and r["cubin"] and r["shared"] <= 227 * 1024 for r in results)
