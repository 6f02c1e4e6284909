"""The server's periodic stats line, as vLLM logs it: every ``interval_s`` seconds in which something happened
(tokens went through, or requests ran or waited), one INFO line with the prompt and generation throughput over
that window, the running / waiting (and swapped) requests, the KV cache usage and the window's prefix-cache
hit rate. Nothing while idle, and never a line per request. Plain Python over EngineStats snapshots; the async
engine's thread feeds it after each step and each idle poll."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("turnout.engine.stats")


class StatsLogger:
    def __init__(self, interval_s: float = 10.0, log: logging.Logger = logger, clock=time.monotonic):
        self.interval_s, self.log, self.clock = interval_s, log, clock
        self._start: float | None = None
        self._prompt = self._generated = self._hits = 0

    def observe(self, stats) -> str | None:
        """Feed one EngineStats snapshot; returns (and logs) the line when a window with activity closes."""
        now = self.clock()
        if self._start is None:
            self._restart(now, stats)
            return None
        dt = now - self._start
        if dt < self.interval_s:
            return None
        prompt = stats.prompt_tokens_total - self._prompt
        generated = stats.generation_tokens_total - self._generated
        hits = stats.prefix_cache_hit_tokens_total - self._hits
        self._restart(now, stats)
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return None
        swapped = f", {stats.num_swapped} swapped" if stats.num_swapped else ""
        hit_rate = f", prefix cache hit rate {100.0 * hits / prompt:.1f} %" if prompt else ""
        line = (f"prompt throughput {prompt / dt:.1f} tokens/s, generation throughput {generated / dt:.1f} tokens/s; "
                f"{stats.num_running} running, {stats.num_waiting} waiting{swapped}; "
                f"KV cache usage {100.0 * stats.kv_cache_usage:.1f} %{hit_rate}")
        self.log.info("%s", line)
        return line

    def _restart(self, now: float, stats) -> None:
        self._start = now
        self._prompt, self._generated = stats.prompt_tokens_total, stats.generation_tokens_total
        self._hits = stats.prefix_cache_hit_tokens_total
