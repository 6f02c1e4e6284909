"""The multi-process executor: a tensor-parallel engine on one machine.

Rank 0, the driver, lives in the engine process: the engine core drives its ModelRunner as in the uniproc
case, so scheduling, the sampler and every per-request stage (penalties, logits processors, grammar masks,
which are Python objects of the requests) stay where the requests are, and only rank 0 samples. Ranks
1..N-1 are spawned processes (``turnout.worker.worker.worker_main``), one per rank, each with its device, model
shard and KV shard. Each step the driver's runner hands this executor the step's host inputs once
(``StepPublisher``, given to it when it is built), and one flat int64 message (turnout/worker/step_codec.py) goes to every other rank over
its private pipe: no per-request object, no pickle on the per-step path. A lookahead step's input tokens (still
on the driver's device) are broadcast over the TP group. The rendezvous is a file store in a private temporary
directory, so no store socket listens at all (gloo's own pair sockets follow the host name, 127.0.0.1 here; set
GLOO_SOCKET_IFNAME=lo to pin them). ``collective_rpc`` pickles (method, args) over the same pipes, which only
this process holds.

The KV block count the scheduler uses is the smallest any rank has room for.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import threading
import weakref

import torch

from turnout.executor.rank_health import RankHealth
from turnout.worker import step_codec

logger = logging.getLogger(__name__)


class StepPublisher:
    """What the driver's ModelRunner calls (``runner.step_publisher``) to send each step to the other ranks."""

    def __init__(self, conns, group, health=None):
        self.conns, self.group, self.health = conns, group, health

    def copy_blocks(self, copy_on_write, kind: bytes = step_codec.COPY) -> None:
        msg = step_codec.encode_copy(copy_on_write, kind)
        for c in self.conns:
            c.send_bytes(msg)

    def swap_out(self, pairs) -> None:
        """(device, host) block copies: every rank copies its own shard of the blocks to its host cache."""
        self.copy_blocks(pairs, step_codec.SWAP_OUT)

    def swap_in(self, pairs) -> None:
        """(host, device) block copies, landing before the next step's forward reads them on every rank."""
        self.copy_blocks(pairs, step_codec.SWAP_IN)

    def step(self, input_ids, positions, meta, sample_idx, has_lanes: bool, input_tokens) -> None:
        pending = input_tokens is not None
        msg = step_codec.encode_step(input_ids, positions, meta, sample_idx, has_lanes, pending)
        if self.health is not None:
            self.health.step_published()
        for c in self.conns:
            c.send_bytes(msg)
        if pending:
            import torch.distributed as dist

            dist.broadcast(input_tokens.to(torch.long).contiguous(), src=0, group=self.group)


class MultiprocExecutor:
    def __init__(self, config, platform, ops, remote=None):
        """``remote``: ranks on other machines (executor/multinode.py ``HeadRendezvous``, the Ray executor's
        actors), reached over authenticated sockets that carry the same messages as the local pipes."""
        import multiprocessing as mp

        from turnout.worker.worker import Worker, worker_main

        world = config.tensor_parallel_size
        self.world_size = world
        _collect_dropped_engines()
        self._dir = tempfile.mkdtemp(prefix="turnout-rdzv-")
        init_method = f"file://{os.path.join(self._dir, 'store')}"
        driver_init, local, self._remote = init_method, world, remote
        if remote is not None:
            driver_init, init_method, local = remote.driver_init_method, remote.init_method, remote.local_ranks
        ctx = mp.get_context("spawn")
        self._procs, self._to, self._from = [], [], []
        self.health = RankHealth(ctx, world, float(config.distributed_timeout_s))
        # PR_SET_PDEATHSIG follows the spawning thread: only ask for it when that thread lives as long as we do
        pdeathsig = threading.current_thread() is threading.main_thread()
        for rank in range(1, local):
            to_r, to_w = ctx.Pipe(duplex=False)
            from_r, from_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(rank, world, init_method, config, to_r, from_w),
                            kwargs={"parent_pid": os.getpid(), "health": self.health.shared, "pdeathsig": pdeathsig},
                            name=f"turnout-worker-{rank}", daemon=True)
            p.start()
            to_r.close()
            from_w.close()
            self._procs.append(p)
            self._to.append(to_w)
            self._from.append(from_r)
        self.health.procs = self._procs
        self._closed = False
        # what the finalizer leaves: this engine's process group (filled once the driver has joined it), so that
        # an engine dropped without shutdown() still frees it and its ranks, and a later engine can start
        self._group: list = []
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._to, self._dir, remote, self._group)
        # the watchdog holds the processes and an event, not this executor, which a dropped engine must free
        started = threading.Event()
        watchdog = threading.Thread(target=_watch_start_up, args=(self._procs, started), daemon=True,
                                    name="turnout-tp-start-up")
        watchdog.start()
        try:
            if remote is not None:  # the other machines' ranks, in rank order after this machine's
                conns = remote.accept()
                self._to += conns
                self._from += conns
            self.worker = Worker(config, rank=0, world_size=world, init_method=driver_init, platform=platform,
                                 ops=ops, runner=False, local_rank=remote.driver_local_rank if remote else None)
            self._group.append(self.worker.tp)
            self._expect("loaded")  # every shard is in memory before the runners' collectives (memory profile)
            self.worker.build_runner(step_publisher=StepPublisher(self._to, self.worker.tp.group, self.health))
            blocks = [self.worker.runner.num_blocks] + self._expect("ready")
        except BaseException:
            self.shutdown()
            raise
        finally:
            started.set()
        self.loaded = self.worker.loaded
        self.runner = _DriverRunner(self.worker.runner, self.health)
        self.health.start_watchdog()
        self.num_blocks = min(blocks)
        logger.info("tensor parallel: %d ranks (%s), %d KV blocks (the least of %s)", world,
                    platform.dist_backend, self.num_blocks, blocks)

    def _expect(self, status: str) -> list:
        values = []
        for conn in self._from:
            got, value = conn.recv()
            if got != status:
                raise RuntimeError(f"tensor-parallel worker failed to start: {value}")
            values.append(value)
        return values

    def driver_rpc(self, method: str, *args):
        """A Worker method on the driver rank only, in this process: a check that must pass before any rank
        is asked to act (the others would only repeat it)."""
        return getattr(self.worker, method)(*args)

    def collective_rpc(self, method, args=(), kwargs=None) -> list:
        """``method`` (a Worker method name, or an importable callable taking the worker first) on every rank,
        the driver's too; the results in rank order."""
        kwargs = kwargs or {}
        msg = step_codec.RPC.ljust(8, b"\0") + pickle.dumps((method, tuple(args), kwargs))
        for c in self._to:
            c.send_bytes(msg)
        fn = getattr(self.worker, method) if isinstance(method, str) else None
        mine = fn(*args, **kwargs) if fn is not None else method(self.worker, *args, **kwargs)
        results = [mine]
        errors = []
        for conn in self._from:
            status, value = conn.recv()
            (results if status == "ok" else errors).append(value)
        if errors:
            raise RuntimeError(f"collective_rpc({method!r}) failed: {'; '.join(errors)}")
        return results

    def shutdown(self) -> None:
        """Tell every rank to quit and wait for it (a stuck one is terminated); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.health.close()
        self._finalizer()
        if not self._group:  # a start-up that failed after the driver joined the world but before it was noted
            from turnout.distributed import destroy_distributed

            destroy_distributed()


class _DriverRunner:
    """Rank 0's ModelRunner as the engine core sees it: the same object (every attribute is its own), except
    that its steps are timed by the step watchdog, and a step that fails because another rank died or hangs
    says which rank (executor/rank_health.py)."""

    def __init__(self, runner, health):
        self._runner, self._health = runner, health

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def execute(self, *args, **kwargs):
        self._health.step_started()
        try:
            return self._runner.execute(*args, **kwargs)
        except Exception as e:
            blamed = self._health.blame(reap_s=2.0)
            if blamed:
                raise RuntimeError(f"tensor-parallel worker {blamed}: {type(e).__name__}: {e}") from e
            raise
        finally:
            self._health.step_ended()


def _watch_start_up(procs, started) -> None:
    """A rank that dies during start-up leaves the others waiting in the rendezvous (until its timeout): say at
    once which one, and how it ended."""
    while not started.wait(0.2):
        for rank, p in enumerate(procs, start=1):
            if p.exitcode is not None and not started.is_set():
                logger.error("tensor-parallel worker rank %d (pid %d) exited with code %s during start-up",
                             rank, p.pid, p.exitcode)
                return


def _collect_dropped_engines() -> None:
    """An engine dropped without shutdown() may sit in a reference cycle, its process group still joined, until
    the garbage collector runs: run it before joining a new one. One still alive is a clear error here, not
    torch.distributed's "trying to initialize the default process group twice"."""
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    if dist.is_initialized():
        raise RuntimeError("tensor_parallel_size > 1: this process already belongs to a torch.distributed process "
                           "group (another tensor-parallel LLM still alive? call its shutdown() first, or use it as "
                           "a context manager: `with LLM(...) as llm:`)")


def _shutdown(procs, conns, rdzv_dir, remote=None, group=()) -> None:
    quit_msg = step_codec.QUIT.ljust(8, b"\0")
    for c in conns:
        try:
            c.send_bytes(quit_msg)
            c.close()
        except OSError:
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    shutil.rmtree(rdzv_dir, ignore_errors=True)
    if remote is not None:
        remote.close()
    from turnout.distributed import current_tp_group, destroy_distributed

    if group and current_tp_group() is group[0]:  # leave the world this engine joined, not a later one's
        destroy_distributed()
