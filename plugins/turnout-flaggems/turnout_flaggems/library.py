"""FlagGems, imported once, lazily, with its real error kept.

``import flag_gems`` detects the device while it imports: on a machine without one it raises
``RuntimeError: No device were detected on your machine``, and a second ``import flag_gems`` in the same
process then fails differently (``AttributeError: 'DeviceDetector' object has no attribute 'vendor_name'``,
from the half-initialised module Python kept). So the first outcome is cached and every implementation
reports that first error as its reason. ``flag_gems.enable()`` is never called: it would register FlagGems
for hundreds of ATen operators process-wide; each wrapper calls the one FlagGems function it needs.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading

from turnout.ops import ImplUnavailable

logger = logging.getLogger("turnout_flaggems")

_lock = threading.Lock()
_outcome: dict = {}  # "module": flag_gems, or "error": why it did not import


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def load():
    """The flag_gems module; ImplUnavailable with the first import's error (the same one every time)."""
    with _lock:
        if "module" not in _outcome and "error" not in _outcome:
            try:
                _outcome["module"] = importlib.import_module("flag_gems")
            except (Exception, SystemExit) as e:  # a device check may also exit; only these implementations lose
                _outcome["error"] = f"import flag_gems failed: {_one_line(e)}"
        if "error" in _outcome:
            raise ImplUnavailable(_outcome["error"])
        return _outcome["module"]


def loader(module: str, wrapper: str, needs: tuple[str, ...]):
    """A zero-argument loader (an ``Impl(factory=True)`` target): ``module.wrapper`` with ``gems=flag_gems``
    bound, once FlagGems imported and has every function in ``needs`` (a renamed one disables this
    implementation with its name, not the start-up)."""
    def load_wrapper():
        gems = load()
        missing = [n for n in needs if not callable(getattr(gems, n, None))]
        if missing:
            raise ImplUnavailable(f"flag_gems {getattr(gems, '__version__', '?')} has no {', '.join(missing)}")
        fn = getattr(importlib.import_module(f"turnout_flaggems.{module}"), wrapper)
        return functools.partial(fn, gems=gems)
    load_wrapper.__name__ = f"load_{wrapper}"
    return load_wrapper


_declined: set[tuple[str, str]] = set()
# op -> the reason of its last declined call (benchmarks/flaggems_ops.py reports it per case)
last_declined: dict[str, str] = {}


def decline(op: str, why: str) -> None:
    """Say once per op and reason that a call shape goes to the next implementation (the call itself goes
    on through the ``fallback`` the resolution bound)."""
    key = (op, why)
    last_declined[op] = why
    if key not in _declined:
        _declined.add(key)
        logger.info("vendor.flaggems %s: %s; those calls go to the next implementation", op, why)
