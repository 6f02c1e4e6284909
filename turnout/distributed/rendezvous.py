"""The TCP rendezvous of an engine whose ranks span machines (``--nnodes`` / the Ray executor).

torch.distributed's own ``tcp://`` / ``env://`` rendezvous makes rank 0's TCPStore listen on every interface
of the machine. Here rank 0 binds the listening socket itself, on the address given (``--master-addr``: the
cluster's own interface, 127.0.0.1 by default), and hands it to the TCPStore (``master_listen_fd``). So the
store listens where it was told and nowhere else, and a port already in use is a start-up error that names
the address, before any rank waits on it. The other ranks join with the ``tcp://ADDR:PORT`` URL
(``init_url``) as clients of that store. Every rank hands ``init_process_group`` a store (``store_for``),
never the URL: torch prefixes the keys of a store it made from a URL, not those of one it is given, so the
two kinds could not meet.
"""

from __future__ import annotations

import datetime
import socket


def init_url(addr: str, port: int) -> str:
    """The ``init_method`` of every rank but rank 0."""
    return f"tcp://[{addr}]:{port}" if ":" in addr else f"tcp://{addr}:{port}"


def _bind(addr: str, port: int) -> socket.socket:
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"master_addr: cannot resolve {addr!r}: {e.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(sockaddr)
        sock.listen(512)
    except OSError as e:
        sock.close()
        where = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        raise ValueError(f"master_port: cannot listen on {where} for the rendezvous: {e.strerror or e} "
                         "(another engine, or a torch.distributed job, holds it? pick another --master-port)") from None
    return sock


def master_store(addr: str, port: int, timeout_s: float = 300.0):
    """Rank 0's TCPStore, listening on ``addr:port`` only. The store owns the socket from then on (it closes
    it when it goes), so the Python object lets go of the descriptor."""
    import torch.distributed as dist

    sock = _bind(addr, port)
    bound = sock.getsockname()[1]
    return dist.TCPStore(addr, bound, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())


def client_store(addr: str, port: int, timeout_s: float = 300.0):
    """A client of rank 0's store (a node's agent reads what the head published); waits up to ``timeout_s``
    for the head to listen."""
    import torch.distributed as dist

    return dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=timeout_s))


def store_for(url: str, rank: int, timeout_s: float = 300.0):
    """The store of ``tcp://ADDR:PORT`` for ``rank``: rank 0 listens there, the others connect."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"init_method: {url!r} is not tcp://ADDR:PORT")
    make = master_store if rank == 0 else client_store
    return make(parts.hostname, parts.port, timeout_s)
