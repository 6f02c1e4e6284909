"""What keeps a spawned rank honest about its parent and its peers (turnout/executor/multiproc.py spawns it):

- it dies with the engine process: ``PR_SET_PDEATHSIG`` on Linux (through ctypes, where libc has prctl), and
  on every platform a thread that sees the parent change (the rank is re-parented when the engine dies);
  the pipe closing ends its loop as well. So neither SIGKILL nor SIGTERM of the engine leaves an orphan;
- Ctrl-C in a terminal reaches the whole process group: a rank ignores SIGINT, since the engine decides when
  its ranks stop (its shutdown tells them to quit);
- it beats: a thread writes the time into the engine's shared array every ``BEAT_S``, so the engine's step
  watchdog can tell a rank that is frozen (SIGSTOP, a deadlock holding the GIL) from one that merely waits
  in a collective for a frozen peer;
- every rank checks that it was given the same configuration as rank 0 (``check_same_config``): on one
  machine the config is the same pickled object, but ranks on other nodes parse their own command lines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

BEAT_S = 0.25
_PR_SET_PDEATHSIG = 1
# Fields a rank may legitimately differ in from rank 0 (a node's own place in the cluster).
_PER_NODE_FIELDS = ("node_rank",)


def die_with_parent(parent_pid: int, pdeathsig: bool = True) -> None:
    """Leave when the engine process goes: SIGKILL from the kernel (Linux, when the spawning thread was the
    parent's main thread: the signal follows the *thread* that spawned), and a watcher thread everywhere."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if pdeathsig and hasattr(os, "sched_getaffinity"):  # Linux
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl in this libc: the watcher below still runs
            pass
    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(1)

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="turnout-parent-watch").start()


def start_heartbeat(beats, rank: int) -> None:
    """``beats[rank] = time.monotonic()`` every BEAT_S (CLOCK_MONOTONIC is one clock for every process)."""
    def beat():
        while True:
            beats[rank] = time.monotonic()
            time.sleep(BEAT_S)

    beats[rank] = time.monotonic()
    threading.Thread(target=beat, daemon=True, name="turnout-heartbeat").start()


def _comparable(value):
    """A config value as every rank can compare it: plain values and containers as they are, nested dataclasses
    field by field, other objects by their repr (a torch.dtype, a Path), except a repr that names an address
    (" at 0x...", e.g. a tokenizer object passed in, like the benchmarks' NullTokenizer): that differs in every
    process, so such an object compares by its class."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _comparable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    text = repr(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>" if " at 0x" in text else text


def config_fields(config) -> dict:
    return {f.name: _comparable(getattr(config, f.name)) for f in dataclasses.fields(config)
            if f.name not in _PER_NODE_FIELDS}


def config_hash(config) -> str:
    return hashlib.sha256(repr(sorted(config_fields(config).items())).encode()).hexdigest()


def check_same_config(config, rank: int, group) -> None:
    """Every rank gathers every rank's config hash (and fields, to name what differs); any rank whose hash is
    not rank 0's fails the start-up of all of them with a ValueError naming the fields."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    mine = (config_hash(config), config_fields(config))
    got = [None] * world
    dist.all_gather_object(got, mine, group=group)
    ref_hash, ref = got[0]
    bad = []
    for r, (h, fields) in enumerate(got):
        if h != ref_hash:
            diff = [f"{k}={fields.get(k)!r} (rank 0: {ref.get(k)!r})" for k in sorted(set(ref) | set(fields))
                    if fields.get(k) != ref.get(k)]
            bad.append(f"rank {r}: " + ", ".join(diff))
    if bad:
        raise ValueError("the ranks were started with different engine configurations (start every node with "
                         "the same flags): " + "; ".join(bad))
