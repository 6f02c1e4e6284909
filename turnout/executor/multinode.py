"""An engine over several machines without Ray: ``--nnodes N --node-rank K --master-addr A --master-port P``.

Node 0 runs the engine (scheduler, HTTP, rank 0 in the engine process, as the mp executor): its ranks
``[0, R)`` with ``R = tensor_parallel_size / nnodes`` ranks per node. Node K > 0 runs ``turnout serve ...
--headless`` (``run_headless``): no engine and no HTTP, only its ranks ``[K R, (K + 1) R)``, one spawned
process each, and it exits when the head goes.

Rendezvous: rank 0's TCPStore listens on A:P only (distributed/rendezvous.py; a busy port is a start-up
error naming the address). The head also listens for its remote ranks' step connections
(executor/step_channel.py) and publishes that address and the connection key in the store; a headless node
reads them there, connects one socket per rank, and hands each to its rank's process, which then runs the
same ``worker_main`` as a local rank of the mp executor. So the head's mp executor drives remote ranks
through the same messages as local ones (``MultiprocExecutor(remote=HeadRendezvous(config))``).

The engine configuration is node 0's: the head sends it (JSON, the EngineConfig fields) down each rank's
connection, and a headless node uses it with only its own node rank. A node started with other engine flags
(or serve's defaults against generate's) therefore cannot run a different shard, batch or dtype; only the
model path must name the same checkpoint on every node.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal

from turnout.distributed import rendezvous

logger = logging.getLogger(__name__)

_ADDRESS_KEY, _AUTH_KEY = "turnout/step_channel/address", "turnout/step_channel/key"


def ranks_of_node(config, node_rank: int) -> range:
    per_node = config.tensor_parallel_size // config.nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def _timeout(config) -> float:
    return float(getattr(config, "distributed_timeout_s", None) or 300.0)


class HeadRendezvous:
    """Node 0's side, what ``MultiprocExecutor(remote=...)`` asks: ``driver_init_method`` (rank 0's store),
    ``init_method`` (the URL its spawned ranks join with), ``local_ranks`` (how many ranks this node runs),
    ``accept()`` (the other nodes' ranks' connections, in rank order), ``close()``."""

    driver_local_rank = 0

    def __init__(self, config):
        from turnout.executor.step_channel import StepListener

        addr, port = config.master_addr, config.master_port
        self.timeout_s = _timeout(config)
        self.driver_init_method = rendezvous.master_store(addr, port, self.timeout_s)
        self.init_method = rendezvous.init_url(addr, port)
        self.local_ranks = len(ranks_of_node(config, 0))
        self.world = config.tensor_parallel_size
        self._config = json.dumps(dataclasses.asdict(config)).encode()
        self._listener = StepListener(addr)
        self.driver_init_method.set(_ADDRESS_KEY, self._listener.address)
        self.driver_init_method.set(_AUTH_KEY, self._listener.key.hex())
        logger.info("multi-node: %d nodes x %d ranks; rendezvous on %s:%d, waiting for nodes 1..%d", config.nnodes,
                    self.local_ranks, addr, port, config.nnodes - 1)

    def accept(self, alive=None):
        try:
            conns = self._listener.accept(range(self.local_ranks, self.world), self.timeout_s, alive)
        finally:
            self._listener.close()
        for conn in conns:
            conn.send_bytes(self._config)
        return conns

    def close(self) -> None:
        self._listener.close()
        self.driver_init_method = None  # the store (and its socket) goes with the last reference


def run_headless(config) -> int:
    """Node ``config.node_rank`` > 0: run this node's ranks until the head goes. Exit status 0 when every rank
    left cleanly (the head quit or closed), 1 otherwise."""
    import multiprocessing as mp

    from turnout.executor.step_channel import connect
    from turnout.worker.worker import worker_main

    if config.nnodes < 2 or not 0 < config.node_rank < config.nnodes:
        raise ValueError(f"node_rank: --headless runs node 1..{config.nnodes - 1} of a multi-node engine "
                         f"(--nnodes >= 2), got node {config.node_rank} of {config.nnodes}")
    timeout = _timeout(config)
    store = rendezvous.client_store(config.master_addr, config.master_port, timeout)
    address = store.get(_ADDRESS_KEY).decode()  # waits (up to the timeout) until the head has published it
    key = bytes.fromhex(store.get(_AUTH_KEY).decode())
    del store
    init_method = rendezvous.init_url(config.master_addr, config.master_port)
    ranks = ranks_of_node(config, config.node_rank)
    logger.info("headless node %d: ranks %d..%d of %d, driver at %s", config.node_rank, ranks[0], ranks[-1],
                config.tensor_parallel_size, address)
    ctx = mp.get_context("spawn")
    procs = []

    def stop(signum, frame):  # SIGTERM: take the ranks down with this process (no orphans)
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        for local_rank, rank in enumerate(ranks):
            conn = connect(address, key, rank, timeout)
            head_config = _head_config(conn.recv_bytes(), config.node_rank)
            p = ctx.Process(target=worker_main, args=(rank, config.tensor_parallel_size, init_method, head_config,
                                                      conn, conn),
                            kwargs={"local_rank": local_rank}, name=f"turnout-worker-{rank}", daemon=True)
            p.start()
            conn.close()  # the rank's process holds its own copy
            procs.append(p)
        for p in procs:
            p.join()
    finally:
        signal.signal(signal.SIGTERM, old)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    codes = [p.exitcode for p in procs]
    if any(codes):
        logger.error("headless node %d: ranks exited with %s", config.node_rank, dict(zip(ranks, codes)))
        return 1
    return 0


def _head_config(raw: bytes, node_rank: int):
    from turnout.config import EngineConfig

    fields = json.loads(raw)
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    if set(fields) - known:
        raise RuntimeError(f"node {node_rank}: node 0 runs another turnout version (engine fields "
                           f"{sorted(set(fields) - known)} unknown here); install the same version on every node")
    return EngineConfig(**{**fields, "node_rank": node_rank})
