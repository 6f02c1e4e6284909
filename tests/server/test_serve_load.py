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
