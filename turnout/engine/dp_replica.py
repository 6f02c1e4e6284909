"""One data-parallel replica: an ``LLMEngine`` in a process of its own, and the engine process's proxy of it.

Why a process per replica: the engine's host work (scheduling, detokenising, the sampler's per-request
stages) is Python and holds the GIL, so replicas as threads of one process would share one core's worth of
host time. A process each really uses N cores (N GPUs: replica r's ranks on devices [r tp, (r + 1) tp)).

``ReplicaClient`` has the part of ``LLMEngine``'s interface that ``AsyncLLMEngine`` drives (``add_request``,
``abort_request``, ``step``, ``has_unfinished_requests``, ``get_stats``), so each replica is stepped by an
``AsyncLLMEngine`` thread of its own exactly as a local engine is. Each call is one message over a private
pipe (only this process and the replica hold its ends; no socket). A step's reply carries the outputs, the
stats and the count of unfinished requests, so stats and ``has_unfinished_requests`` cost no round trip.

Faults: a replica that dies (its pipe closes) or does not answer within ``distributed_timeout_s`` makes the
call raise a RuntimeError naming the replica (pid, exit code), which kills its ``AsyncLLMEngine`` thread
loudly, as any engine fault; a step that fails inside the replica (a TP rank of its own died) is sent back
with its message and the replica exits. A replica dies with the engine process (turnout/worker/lifecycle.py).
"""

from __future__ import annotations

import logging
import os
import pickle
import traceback

from turnout.engine.core_outputs import EngineStats

logger = logging.getLogger(__name__)


def replica_main(conn, config, parent_pid: int, pdeathsig: bool) -> None:
    """The replica process: build the engine, say ready (with what the server needs of it), then answer."""
    from turnout.worker.lifecycle import die_with_parent

    die_with_parent(parent_pid, pdeathsig)
    try:
        import torch

        if config.data_parallel_size > 1:  # replicas share the host's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // config.data_parallel_size))
        from turnout.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        info = {"tokenizer": engine.tokenizer, "max_model_len": engine.max_model_len,
                "model_name": engine.model_name, "vocab_size": engine.runner.vocab_size,
                "eos_ids": sorted(engine.eos_ids), "pid": os.getpid()}
        conn.send(("ready", pickle.dumps(info)))
    except BaseException as e:  # noqa: BLE001 - reported to the engine process, which fails its start-up
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    try:
        _serve(conn, engine)
    finally:
        shutdown = getattr(engine.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _serve(conn, engine) -> None:
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):  # the engine process is gone
            return
        op = cmd[0]
        if op == "quit":
            return
        try:
            if op == "step":
                result = engine.step()
            elif op == "add":
                engine.add_request(*cmd[1:])
                result = None
            elif op == "abort":
                engine.abort_request(cmd[1])
                result = None
            else:
                raise ValueError(f"unknown replica command {op!r}")
        except Exception as e:  # noqa: BLE001
            if op == "step":  # no request owns it: the engine is dead; say why, then leave
                conn.send(("dead", f"{type(e).__name__}: {e}"))
                return
            conn.send(("error", _portable(e)))
            continue
        conn.send(("ok", result, engine.get_stats(), engine.get_num_unfinished_requests()))


def _portable(e: Exception) -> Exception:
    """The exception itself where it survives pickling (ValueError, ContextLengthError), else its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


class ReplicaClient:
    """The engine process's side of replica ``index``: start it with ``start()``, wait with ``wait_ready()``."""

    def __init__(self, config, index: int, ctx):
        import threading

        self.index, self.config = index, config
        self._conn, child = ctx.Pipe(duplex=True)
        pdeathsig = threading.current_thread() is threading.main_thread()
        self.proc = ctx.Process(target=replica_main, args=(child, config, os.getpid(), pdeathsig),
                                name=f"turnout-dp-replica-{index}", daemon=False)
        self.proc.start()
        child.close()
        self.stats = EngineStats()
        self._unfinished = 0
        self.info: dict = {}

    def wait_ready(self) -> dict:
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise RuntimeError(f"data-parallel replica {self.index} (pid {self.proc.pid}) exited with code "
                               f"{self.proc.exitcode} during start-up") from None
        if status != "ready":
            raise RuntimeError(f"data-parallel replica {self.index} failed to start: {payload}")
        self.info = pickle.loads(payload)
        return self.info

    # ---- what AsyncLLMEngine drives -------------------------------------------------------------
    def _call(self, *cmd):
        timeout = float(self.config.distributed_timeout_s)
        try:
            self._conn.send(cmd)
            if not self._conn.poll(timeout):
                raise RuntimeError(f"data-parallel replica {self.index} (pid {self.proc.pid}) hung: no answer to "
                                   f"{cmd[0]!r} within {timeout:g}s (distributed_timeout_s)")
            reply = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.proc.join(timeout=2)
            raise RuntimeError(f"data-parallel replica {self.index} (pid {self.proc.pid}, exit code "
                               f"{self.proc.exitcode}) died") from None
        if reply[0] == "dead":
            self.proc.join(timeout=10)
            raise RuntimeError(f"data-parallel replica {self.index} (pid {self.proc.pid}) failed: {reply[1]}")
        if reply[0] == "error":
            raise reply[1]
        _, result, self.stats, self._unfinished = reply
        return result

    def add_request(self, request_id, prompt, params=None, arrival_time=None) -> None:
        self._call("add", request_id, prompt, params, arrival_time)

    def abort_request(self, request_id) -> None:
        self._call("abort", request_id)

    def step(self):
        return self._call("step")

    def has_unfinished_requests(self) -> bool:
        return self._unfinished > 0

    def get_num_unfinished_requests(self) -> int:
        return self._unfinished

    def get_stats(self) -> EngineStats:
        return self.stats

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the replica to quit and wait for it; kill it if it does not go."""
        try:
            self._conn.send(("quit",))
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()
