"""The server process's socket and signals: the listening socket, bound before the model loads, and the
uvicorn server whose first SIGTERM drains. Apart from serve_cmd.py, which parses the flags and wires the
app, because these own the process's lifetime (serve_cmd.py's docstring: drain and exit status).
"""

from __future__ import annotations

import asyncio
import logging
import signal

logger = logging.getLogger("turnout.serve")


def bind_socket(host: str, port: int):
    """Listen on host:port now, before the model loads (seconds to minutes), so a port in use is an
    error at once that names the address, not a crash after loading."""
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"--port: must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host: cannot resolve {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise ValueError(f"--port: cannot listen on {where}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class DrainingServer:
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of closing the listening socket."""

    def __new__(cls, config, state):
        import uvicorn

        class DrainingServer(uvicorn.Server):
            def __init__(self, config, state):
                super().__init__(config)
                self.state = state
                self._drain_requested = False
                self._drain_task = None

            def exit_now(self):
                self.should_exit = True

            def handle_exit(self, sig, frame):  # a signal handler: only set flags here
                if self._drain_requested or self.state.phase != "ready":
                    self.should_exit = True
                    if self._drain_task is not None and sig == signal.SIGINT:
                        self.force_exit = True
                    return
                self._drain_requested = True
                self.state.start_draining()

            async def on_tick(self, counter):
                if self._drain_requested and self._drain_task is None:
                    self._drain_task = asyncio.ensure_future(self._drain())
                return await super().on_tick(counter)

            async def _drain(self):
                eng = self.state.async_engine
                n = eng.num_in_flight if eng else 0
                logger.info("shutting down: refusing new requests, draining %d in-flight request(s) "
                            "(up to %.0fs)", n, self.state.drain_timeout)
                if eng is not None:
                    await eng.shutdown(self.state.drain_timeout)
                logger.info("drained; exiting")
                self.should_exit = True

        return DrainingServer(config, state)
