"""The driver's line to ranks on other machines (``--nnodes`` nodes, Ray actors): one TCP connection per rank,
with the same ``send_bytes`` / ``recv_bytes`` / ``send`` / ``recv`` interface as the pipes the mp executor
gives its local ranks. So the step messages (worker/step_codec.py: flat int64, never pickled), the start-up
statuses, ``collective_rpc`` and the quit message travel exactly as they do on one machine, and a rank's
loop (``Worker.serve``) cannot tell the two apart.

The driver listens on the address it is given (the cluster's own interface; never 0.0.0.0 by default),
accepts exactly the ranks it expects, then closes the listener. Every connection is authenticated with a
random 32-byte key (multiprocessing's HMAC challenge, both ways) before anything is read from it, so the
pickled ``collective_rpc`` messages come only from the driver and go only to its ranks. The key reaches a
rank through Ray's actor arguments or the rendezvous store, which is as trusted as torch.distributed's
own traffic on that network.

Why not a collective (a broadcast over the TP group) for the step messages: a rank waiting for the next step
of an idle engine would sit in a collective past the group's timeout. A socket waits as long as needed, and
it closes when the driver goes, so a rank on another machine leaves by itself.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge

_HANDSHAKE_S = 10  # seconds a connecting peer has for each message of the handshake


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


class StepListener:
    """The driver's end: ``accept(ranks)`` returns one authenticated connection per rank, in rank order."""

    def __init__(self, host: str):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(64)
        except OSError as e:
            self._sock.close()
            raise ValueError(f"master_addr: cannot listen on {host!r} for the worker connections: "
                             f"{e.strerror or e}") from None
        self.key = os.urandom(32)
        self.address = format_address(host, self._sock.getsockname()[1])

    def accept(self, ranks, timeout_s: float = 300.0, alive=None) -> list[Connection]:
        """Wait for every rank in ``ranks`` (each says its rank first); ``alive()``, polled each second, may
        raise to stop waiting for ranks that can no longer come."""
        want, got = set(ranks), {}
        deadline = time.monotonic() + timeout_s
        self._sock.settimeout(1.0)
        while want - got.keys():
            if time.monotonic() > deadline:
                missing = sorted(want - got.keys())
                raise RuntimeError(f"tensor-parallel ranks {missing} did not connect to {self.address} within "
                                   f"{timeout_s:.0f}s (are their nodes started, with the same --master-addr / "
                                   "--master-port?)")
            if alive is not None:
                alive()
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            conn, rank = _handshake(sock, self.key)
            if rank not in want or rank in got:  # a stranger, a wrong key, a rank twice
                if conn is not None:
                    conn.close()
                continue
            got[rank] = conn
        return [got[r] for r in sorted(got)]

    def close(self) -> None:
        self._sock.close()


def connect(address: str, key: bytes, rank: int, timeout_s: float = 300.0) -> Connection:
    """A rank's end: connect (retrying until the driver listens), authenticate, say which rank this is."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = Client(parse_address(address), authkey=key)
            break
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: the driver at {address} did not answer within "
                                   f"{timeout_s:.0f}s") from None
            time.sleep(0.2)
    conn.send_bytes(struct.pack("<q", rank))
    return conn


def _handshake(sock: socket.socket, key: bytes) -> tuple[Connection | None, int | None]:
    """The HMAC challenge both ways, then the peer's rank, each read bounded by an OS receive timeout (a peer
    that connects and says nothing cannot stall the driver); after it the socket blocks for as long as a step
    takes to come."""
    timeout = struct.pack("ll", _HANDSHAKE_S, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
        (rank,) = struct.unpack("<q", conn.recv_bytes(8))
    except (AuthenticationError, OSError, EOFError, struct.error):
        conn.close()
        return None, None
    fd_sock = socket.socket(fileno=os.dup(conn.fileno()))
    fd_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
    fd_sock.close()
    return conn, rank
