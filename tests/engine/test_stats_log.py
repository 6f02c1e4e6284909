"""The server's periodic stats line (turnout/engine/stats_log.py): one line a window with activity, with the
window's throughputs, the queue and the KV usage; none while idle or before the window closes."""

from __future__ import annotations

import dataclasses
import logging

from turnout.engine.llm_engine import EngineStats
from turnout.engine.stats_log import StatsLogger


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_one_line_per_active_window(caplog):
    clock = Clock()
    log = StatsLogger(10.0, clock=clock)
    s = EngineStats()
    with caplog.at_level(logging.INFO, logger="turnout.engine.stats"):
        assert log.observe(s) is None  # the first snapshot opens the window
        s = dataclasses.replace(s, prompt_tokens_total=400, generation_tokens_total=50, num_running=3,
                                num_waiting=2, kv_cache_usage=0.125, prefix_cache_hit_tokens_total=100)
        clock.t += 4.0
        assert log.observe(s) is None  # the window is still open
        clock.t += 6.0
        line = log.observe(s)
        assert line == ("prompt throughput 40.0 tokens/s, generation throughput 5.0 tokens/s; 3 running, "
                        "2 waiting; KV cache usage 12.5 %, prefix cache hit rate 25.0 %")
        assert [r.getMessage() for r in caplog.records] == [line]
        s = dataclasses.replace(s, num_running=0, num_waiting=0, kv_cache_usage=0.0)
        clock.t += 10.0
        assert log.observe(s) is None  # idle: no tokens, nothing queued -> nothing logged
        s = dataclasses.replace(s, generation_tokens_total=70, num_running=1, num_swapped=1)
        clock.t += 20.0
        assert log.observe(s) == ("prompt throughput 0.0 tokens/s, generation throughput 1.0 tokens/s; 1 running, "
                                  "0 waiting, 1 swapped; KV cache usage 0.0 %")
    assert len(caplog.records) == 2
