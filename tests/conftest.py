import os

# Triton kernels run under the interpreter where there is no GPU. This must be set before any
# kernel module is imported (triton.jit reads it at decoration time).
try:
    import torch

    _has_gpu = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_gpu = False
if not _has_gpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # tests/ is on sys.path (pytest puts a conftest's directory there: no __init__.py). tl.dot row by row: a
    # row's bits then do not depend on the machine's BLAS kernel (see tests/_interpreter_dot.py)
    import _interpreter_dot

    _interpreter_dot.install()

import pytest  # noqa: E402

from turnout import envs  # noqa: E402


@pytest.fixture(autouse=True)
def _envs_follow_the_environment():
    """turnout.envs reads the environment once; a test that changes it calls ``envs.reload()``, and this puts
    the process's settings back after the test (autouse: torn down after monkeypatch has undone its changes)."""
    yield
    envs.reload()


def pytest_collection_modifyitems(config, items):
    if _has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
