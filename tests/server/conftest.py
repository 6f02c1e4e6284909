"""Fixtures: a real `turnout serve` subprocess (default model, once per session) and in-process servers
around the fake engine for edge cases."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_fakes, serve_load helpers

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = float(os.environ.get("TURNOUT_TEST_STARTUP_TIMEOUT", "240"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None, entry: tuple[str, ...] = ("-m", "turnout.entrypoints.cli")):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"turnout-serve-{self.port}.log"
        self._log = open(self.log_path, "w+")
        cmd = [sys.executable, *entry, "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"turnout serve exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"turnout serve not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-6000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGINT)  # a second signal: stop now
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._log.close()
        return self.proc.returncode


# Small limits keep the CPU suite fast; --max-num-seqs 8 lets the load test run 8 at once.
MAIN_SERVER_ARGS = ("--max-model-len", "512", "--max-num-seqs", "8", "--max-queue", "64", "--seed", "0")


class _External:
    def __init__(self, url):
        self.base_url = url.rstrip("/")


@pytest.fixture(scope="session")
def server():
    if os.environ.get("TURNOUT_TEST_SERVER_URL"):  # reuse a running `turnout serve` (started with MAIN_SERVER_ARGS)
        yield _External(os.environ["TURNOUT_TEST_SERVER_URL"])
        return
    srv = ServerProcess(*MAIN_SERVER_ARGS)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def model_name(server):
    return httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]


class InProcessServer:
    """uvicorn in a background thread around a ServerState (usually with a FakeEngine)."""

    def __init__(self, state):
        import uvicorn

        from turnout.entrypoints.openai.api_server import build_app

        self.state = state
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(state), host="127.0.0.1", port=self.port, log_level="warning",
                                access_log=False, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            # an engine given up front: wait until it is served; a factory: only until uvicorn listens
            if self.server.started and (self.state.engine_factory or self.state.phase != "loading"):
                return self
            time.sleep(0.02)
        raise TimeoutError("in-process server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def fake_server():
    """Factory: `with fake_server(engine=FakeEngine(...), api_key=...) as srv:`."""
    from serve_fakes import FakeEngine
    from turnout.entrypoints.openai.api_server import ServerState

    def make(engine=None, **kwargs):
        engine = engine or FakeEngine()
        kwargs.setdefault("max_num_seqs", engine.max_num_seqs)
        return InProcessServer(ServerState(engine=engine, **kwargs))

    return make
