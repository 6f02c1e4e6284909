"""A load that is not on a terminal (a server's log) says how far it is at INFO, at most every LOG_EVERY_S."""

from __future__ import annotations

import logging

from turnout.loader import _Progress


def test_progress_is_logged_when_there_is_no_terminal(caplog, monkeypatch):
    monkeypatch.setattr(_Progress, "LOG_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="turnout.loader"):
        p = _Progress("Loading tiny")
        assert p.bar.disable  # pytest's stderr is no terminal
        p.doing("weights", total=4)
        for _ in p.over(range(4), "weights"):
            pass
        p.close()
    assert [r.getMessage() for r in caplog.records] == [f"Loading tiny: {pct} % (weights)" for pct in (25, 50, 75, 100)]
    monkeypatch.setattr(_Progress, "LOG_EVERY_S", 3600.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="turnout.loader"):
        p = _Progress("Loading tiny")
        p.doing("weights", total=4)
        for _ in p.over(range(4), "weights"):
            pass
    assert not caplog.records  # a short load stays quiet
