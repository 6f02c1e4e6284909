"""Death is loud: a real `turnout serve` whose engine dies from a fault no request owns fails every
waiting client, zeroes its gauges, answers 503, and exits 1 within its grace so a supervisor restarts
it. The fault is injected by tests/server/fault_serve.py into the real engine's step."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx

from conftest import REPO, ServerProcess

FAULT_ENTRY = (str(REPO / "tests" / "server" / "fault_serve.py"),)
ARGS = ("--max-model-len", "256", "--max-num-seqs", "4")
GRACE = 2.0


def gauges(srv) -> dict:
    text = httpx.get(f"{srv.base_url}/metrics", timeout=5).text
    return {k: float(v) for k, v in re.findall(r"^(turnout_[a-z_]+) ([0-9.eE+-]+)$", text, re.M)}


class Waiter(threading.Thread):
    """A long streaming request that is in flight when the engine dies."""

    def __init__(self, srv):
        super().__init__(daemon=True)
        self.srv, self.status, self.events, self.first = srv, None, [], threading.Event()

    def run(self):
        body = {"prompt": "Count to a thousand:", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.srv.base_url}/v1/completions", json=body, timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.first.set()
        self.first.set()


def _kill_engine(srv):
    return httpx.post(f"{srv.base_url}/v1/completions", timeout=30,
                      json={"prompt": "Hi", "max_tokens": 4, "stop": ["KILL-ENGINE"]})


def test_engine_death_fails_everyone_and_exits_1_within_the_grace():
    srv = ServerProcess(*ARGS, "--dead-engine-grace", str(GRACE), entry=FAULT_ENTRY)
    try:
        srv.wait_healthy()
        assert httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                          timeout=30).status_code == 200
        waiter = Waiter(srv)
        waiter.start()
        assert waiter.first.wait(30) and waiter.status == 200
        r = _kill_engine(srv)
        t_dead = time.monotonic()
        # the request that was running when the step failed: an error, not a hang (not its fault: 5xx)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "engine_dead"
        waiter.join(10)
        assert not waiter.is_alive()
        assert waiter.events[-1] == "[DONE]" and '"engine_dead"' in waiter.events[-2]
        # within the grace: it still answers, and says it is dead
        assert httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 503
        g = gauges(srv)
        assert g["turnout_engine_healthy"] == 0
        for name in ("num_requests_running", "num_requests_waiting", "num_requests_in_flight",
                     "kv_cache_usage_perc"):
            assert g[f"turnout_{name}"] == 0, (name, g)
        r = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        rc = srv.proc.wait(GRACE + 8)
        elapsed = time.monotonic() - t_dead
        assert rc == 1, srv.log()
        assert GRACE - 0.5 <= elapsed <= GRACE + 6, elapsed
        assert "engine died" in srv.log()
    finally:
        srv.stop()


def test_sigterm_on_a_dead_engine_exits_1():
    srv = ServerProcess(*ARGS, "--dead-engine-grace", "120", entry=FAULT_ENTRY)
    try:
        srv.wait_healthy()
        assert _kill_engine(srv).status_code == 500
        assert httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 503
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(10) == 1, srv.log()
        assert time.monotonic() - t0 < 8
    finally:
        srv.stop()
