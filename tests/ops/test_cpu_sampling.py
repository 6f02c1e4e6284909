"""vendor.cpu sample skips the sort for rows that filter nothing: every row must draw what the reference draws."""

import pytest
import torch

from turnout.ops.reference.sampling import sample as reference
from turnout.ops.vendors.cpu.sampling import sample


@pytest.mark.parametrize("trial", range(8))
def test_cpu_sample_equals_the_reference_row_for_row(trial):
    g = torch.Generator().manual_seed(trial)
    b, v = 64, 5003
    logits = torch.randn(b, v, generator=g) * 3
    temp = torch.rand(b, generator=g) * 2
    temp[::5] = 0
    top_k = torch.randint(-1, 30, (b,), generator=g, dtype=torch.int32)
    top_k[::2] = 0
    top_k[1::7] = v + 5  # past the vocabulary: off
    top_p = torch.where(torch.rand(b, generator=g) < 0.5, torch.ones(b), torch.rand(b, generator=g))
    min_p = torch.where(torch.rand(b, generator=g) < 0.7, torch.zeros(b), torch.rand(b, generator=g) * 0.2)
    seeds = torch.randint(0, 2**62, (b,), generator=g)
    steps = torch.randint(0, 1000, (b,), generator=g)
    args = (logits, temp, top_k, top_p, min_p, seeds, steps)
    plain = (temp != 0) & (top_k <= 0) & (top_p >= 1) & (min_p == 0)
    assert plain.any() and (~plain & (temp != 0)).any()  # both paths are exercised
    assert torch.equal(sample(*args), reference(*args))
