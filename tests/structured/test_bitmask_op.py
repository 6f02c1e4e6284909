"""apply_token_bitmask: the reference against xgrammar's own implementation (the peer), the Triton kernel
(interpreted on CPU) on strided rows and a full-size vocabulary, and the shape errors.

The generic conformance suite (tests/ops/test_conformance.py) runs the Triton kernel on the op's sample
cases; this file adds what it cannot: an independent implementation of the meaning.
"""

from __future__ import annotations

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")

from turnout.ops.reference.bitmask import APPLY_TOKEN_BITMASK, apply_token_bitmask, random_bitmask
from turnout.ops.triton import bitmask as triton_bitmask

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cases():
    for _, case in ((d, c) for d in ["float32"] for c in APPLY_TOKEN_BITMASK.sample_inputs(
            "cpu", torch.float32, torch.Generator().manual_seed(3))):
        yield case


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c.label)
def test_reference_equals_xgrammar(case):
    logits, mask, indices = case.args
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask(ours, mask, indices)
    xgrammar.apply_token_bitmask_inplace(theirs, mask, vocab_size=logits.shape[1],
                                         indices=None if indices is None else indices.tolist(),
                                         backend="torch_native")
    assert torch.equal(ours, theirs)
    if indices is not None and indices.numel():  # rows left out are untouched
        untouched = sorted(set(range(logits.shape[0])) - set(indices.tolist()))
        assert torch.equal(ours[untouched], logits[untouched])


def test_every_allowed_row_is_untouched_and_no_allowed_row_is_all_inf():
    logits = torch.randn(2, 70)
    mask = torch.stack([torch.full((3,), -1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)])
    out = logits.clone()
    apply_token_bitmask(out, mask)
    assert torch.equal(out[0], logits[0])
    assert torch.isinf(out[1]).all() and (out[1] < 0).all()


def test_triton_kernel_on_strided_rows_and_full_vocab():
    # Logits rows that are a view of a wider buffer (stride(0) > V), SmolLM2's padded vocabulary size.
    g = torch.Generator().manual_seed(0)
    v = 49216
    base = torch.randn(3, v + 100, generator=g).to(DEV)
    logits = base[:, :v]
    tail = base[:, v:].clone()
    mask = random_bitmask(3, v, (v + 31) // 32, g, 0.3).to(DEV)
    want = logits.clone()
    apply_token_bitmask(want, mask)
    triton_bitmask.apply_token_bitmask(logits, mask, None)
    assert torch.equal(logits, want)
    assert torch.equal(base[:, v:], tail)  # nothing written past V in the wider rows
    idx = torch.tensor([2], device=DEV)
    again = torch.randn(3, v, generator=g).to(DEV)
    want = again.clone()
    apply_token_bitmask(want, mask, idx)
    triton_bitmask.apply_token_bitmask(again, mask, idx)
    assert torch.equal(again, want)


@pytest.mark.parametrize("impl", [apply_token_bitmask, triton_bitmask.apply_token_bitmask], ids=["reference", "triton"])
def test_shape_errors_name_the_problem(impl):
    logits = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="need 4"):
        impl(logits, torch.zeros(2, 3, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="int32"):
        impl(logits, torch.zeros(2, 4, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="indices"):
        impl(logits, torch.zeros(1, 4, dtype=torch.int32), None)
