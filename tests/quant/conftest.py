"""Fixtures shared by the fp8 tests."""

from __future__ import annotations

import pytest
import torch

from turnout.ops import resolve
from turnout.platforms.detect import detect_platform


@pytest.fixture(scope="module")
def cpu_ops():
    """The op table a CPU engine resolves (references and vendor.cpu; Triton under the interpreter)."""
    return resolve(detect_platform("cpu"))


@pytest.fixture(scope="module")
def ids():
    """20 token ids of the tiny models' 384-token vocabulary."""
    return torch.randint(0, 384, (20,), generator=torch.Generator().manual_seed(1))
