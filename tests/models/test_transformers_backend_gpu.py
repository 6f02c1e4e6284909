"""The transformers backend on the GPU: every architecture of the CPU set through the conformance check on the
GPU's op table (float32; HF on the CPU), with the engine's defaults there (CUDA graphs where the model's forward does
not synchronise with the host, async scheduling)."""

from __future__ import annotations

import pytest

from test_transformers_backend import ARCHITECTURES  # this directory is on sys.path (pytest, no packages)
from turnout.entrypoints.models_check import check_architecture

GPU_LOGITS_TOLERANCE = 1e-3  # float32 on the GPU's kernels (Triton attention, cuBLAS) against HF's on the CPU


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_architecture_matches_hf_on_gpu(model_type):
    res = check_architecture(model_type, "transformers", device="cuda", tokens=32)
    assert res.error is None, res.error
    assert res.max_logit_diff <= GPU_LOGITS_TOLERANCE, f"{res.architecture}: {res.max_logit_diff:.2e}"
    assert res.greedy_equal, f"{res.architecture}: greedy tokens differ from transformers'"
