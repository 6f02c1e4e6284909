import pytest

from turnout import envs


@pytest.fixture(autouse=True)
def _fresh_envs():
    """Settings are read once per process (turnout/envs.py); a test that sets a variable calls
    ``envs.reload()``, and this puts the process's own values back after it (and its monkeypatch) ends."""
    yield
    envs.reload()
