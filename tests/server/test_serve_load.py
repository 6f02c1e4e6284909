"""benchmarks/serve_load.py, briefly, against the session server."""

from __future__ import annotations

import asyncio
import importlib.util

from conftest import REPO


def _load_bench():
    spec = importlib.util.spec_from_file_location("serve_load", REPO / "benchmarks" / "serve_load.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_load_with_random_disconnects(server):
    bench = _load_bench()
    res = asyncio.run(bench.run_load(server.base_url, num_requests=12, concurrency=6, max_tokens=8,
                                     disconnect_frac=0.35, seed=1, verify=2))
    print(bench.format_table(res))
    assert not res["failures"], res["failures"]
    o = res["outcomes"]
    assert sum(o.values()) == 12 and o["error"] == 0 and o["rejected"] == 0
    assert o["disconnected"] >= 1 and o["ok"] >= 2
    assert res["server_after"]["idle"]


def test_mixed_load_mode(server):
    """The mixed mode runs and reports both phases (its numbers are for docs/benchmarks.md, not asserted)."""
    bench = _load_bench()
    res = asyncio.run(bench.run_mixed(server.base_url, num_short=6, concurrency=3, short_max_tokens=2, big_n=6,
                                      big_max_tokens=4, seed=1, rounds=2))
    print(bench.format_mixed_table(res))
    assert not res["failures"], res["failures"]
    assert res["mixed"]["big"]["completion_tokens"] == 24
    for phase in ("alone", "mixed"):
        assert res[phase]["short_ttft_s"]["p99"] is not None
    assert res["p99_ttft_ratio"] > 0 and len(res["mixed"]["rounds"]) == 2
