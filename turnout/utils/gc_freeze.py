"""Keep the start-up heap out of Python's cyclic garbage collector, in the processes turnout owns.

After start-up a server or benchmark process holds hundreds of thousands of long-lived objects (the model's
modules and parameters, the tokenizer, the op table, imported modules). The collector's oldest generation
scans them all on each full collection: with a 256-sequence batch on a CPU, one such collection every few
dozen steps cost 4.6 ms a step on average, as a pause of a couple of hundred milliseconds in one step
(docs/benchmarks.md, seventeenth session). ``gc.freeze()`` moves every object alive now to a permanent
generation the collector does not scan (vLLM does the same once its engine is up). Frozen objects are still
freed by reference counting; only cycles among them wait for ``gc.unfreeze()``. So this is for processes that
keep their engine until they exit (``turnout serve``, ``turnout bench``), not for the ``LLM`` class, whose users
may drop an engine and build another in the same process.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """One full collection, then every object alive is frozen; returns how many are (``gc.get_freeze_count``)."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    logger.debug("gc: %d start-up objects frozen (not scanned by the cyclic collector)", n)
    return n


def collect_all() -> None:
    """A full collection that also reaches frozen objects: what releasing device memory needs (an engine's
    sleep drops its KV cache and graphs, whose cycles may have been alive, so frozen, at start-up). Where
    the heap was frozen, it is frozen again after (what is alive then: the serving process's new start-up
    heap); where it was not (an ``LLM`` in a user's process), the collector is left as it was."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()


def release_device_memory(device) -> None:
    """After dropping the last references to device tensors (a rank's sleep, an engine's shutdown): collect
    their cycles (``collect_all``; an exception's traceback can hold storage too), then, on a GPU, hand the
    freed blocks back to the device, not only to torch's caching allocator."""
    import torch

    collect_all()
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
