"""Resolve every op once, at engine start, into a frozen table of callables.

After resolution, ``table.rms_norm(...)`` is a plain attribute lookup. Only the first call of each op
goes through a guard that implements fallback: an implementation that raises on its first call is
marked failed and the next available candidate is used, with a warning. An op that writes into its
arguments is retried only from a copy of them taken before the call (they may be partly written); past
SNAPSHOT_LIMIT_BYTES no copy is taken and the failure is an error saying so. Never in strict mode. Once a call
succeeds the table attribute is replaced by the implementation's own function: nothing runs per call.
Take the first call of every op (a warm-up step) before CUDA-graph capture or ``torch.compile``.

How one op's candidates are ordered, probed and chosen is ops/resolution.py; this module builds the table
from those resolutions, runs the first-call fallback, and reports the table at start-up.
"""

from __future__ import annotations

import inspect
import logging
import threading
import warnings
from typing import Callable

import torch

from turnout.ops.policy import Policy
from turnout.ops.registry import Registry, default_registry
from turnout.ops.resolution import Resolution, resolve_op
from turnout.ops.spec import Impl

logger = logging.getLogger(__name__)


class OpUnavailableError(RuntimeError):
    """No implementation of an op can run on this platform under this policy."""


class OpFailedError(RuntimeError):
    """An implementation failed on first use and fallback was not allowed."""


class OpTable:
    """The frozen op table an engine runs with: one attribute per op."""

    def __init__(self, platform, policy: Policy, resolutions: dict[str, Resolution], registry: Registry):
        object.__setattr__(self, "platform", platform)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "resolutions", resolutions)
        object.__setattr__(self, "_registry", registry)
        for op, res in resolutions.items():
            if res.chosen is not None:  # an optional op nothing serves gets no attribute (never a None)
                object.__setattr__(self, op, _FirstCallGuard(self, op))

    def __setattr__(self, name, value):
        raise AttributeError(f"the op table is frozen; {name!r} cannot be assigned")

    def __getattr__(self, name):  # only reached for names that are not ops of this table
        if name.startswith("__"):
            raise AttributeError(name)
        res = self.resolutions.get(name)
        if res is not None:  # an optional op with no implementation here
            raise OpUnavailableError(res.error or (f"op {name!r} is not needed on this platform: {res.not_needed}"
                                                   if res.not_needed else f"op {name!r} has no implementation here"))
        raise AttributeError(f"the op table has no op {name!r}; it has: {', '.join(sorted(self.resolutions))}")

    def _settle(self, op: str, fn: Callable) -> None:
        object.__setattr__(self, op, fn)

    def chosen(self, op: str) -> str | None:
        return self.resolutions[op].chosen

    def available(self, op: str) -> bool:
        """Whether the table serves ``op`` (False for an optional op with no implementation here, or an op
        this table was not resolved for)."""
        res = self.resolutions.get(op)
        return res is not None and res.chosen is not None

    def chosen_impl(self, op: str) -> Impl | None:
        """The declaration (``Impl``) of the implementation chosen for ``op``; None if the table has no such op."""
        res = self.resolutions.get(op)
        return None if res is None or res.chosen is None else self._registry.get_impl(op, res.chosen)

    def report(self) -> list[dict]:
        return [r.to_dict() for r in self.resolutions.values()]

    def format_table(self) -> str:
        rows = [("op", "chosen", "skipped (why)")]
        for r in self.resolutions.values():
            skipped = "; ".join(f"{c.impl}: {r.skip_reason(c)}" for c in r.candidates if c.impl != r.chosen)
            rows.append((r.op, r.chosen or "-", skipped or "-"))
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        return "\n".join(f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)


class _FirstCallGuard:
    """Runs an op's first call; on success the table points straight at the implementation."""

    def __init__(self, table: OpTable, op: str):
        self.table = table
        self.op = op
        self.lock = threading.Lock()
        self.error: OpFailedError | None = None  # sticky: an in-place or strict failure

    def __repr__(self):
        return f"<first call of op {self.op!r} -> {self.table.resolutions[self.op].chosen}>"

    def __call__(self, *args, **kwargs):
        with self.lock:
            current = self.table.__dict__[self.op]
            if current is not self:  # another thread settled it meanwhile
                return current(*args, **kwargs)
            return self._first_call(args, kwargs)

    def _first_call(self, args, kwargs):
        table, op = self.table, self.op
        if self.error is not None:
            raise self.error
        res = table.resolutions[op]
        spec = table._registry.ops[op]
        while True:
            cand = res.candidate(res.chosen)
            saved = _snapshot(spec, args, kwargs) if spec.inplace and not table.policy.strict else None
            try:
                out = cand.fn(*args, **kwargs)
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
                cand.available, cand.reason = False, f"failed on first use: {err}"
                where = f"op {op!r} implementation {cand.impl} on platform {table.platform.name}"
                if table.policy.strict:
                    self.error = OpFailedError(f"{where} failed on first use and the policy is strict "
                                               f"({table.policy.source}), so there is no fallback: {err}")
                    raise self.error from e
                if spec.inplace and saved is not None:
                    _restore(saved)  # as before the call: the next candidate runs on the caller's values
                elif spec.inplace:
                    self.error = OpFailedError(
                        f"{where} failed on first use: {err}. Not retried with another implementation: the "
                        f"op writes into {', '.join(spec.mutates)}, which may be partly written and are too "
                        f"large to keep a copy of ({SNAPSHOT_LIMIT_BYTES >> 20} MiB). Deny it "
                        f"(TURNOUT_OPS='deny={cand.impl}') to use the next candidate")
                    raise self.error from e
                nxt = next((c for c in res.candidates if c.available), None)
                if nxt is None:
                    raise OpUnavailableError(f"{where} failed on first use ({err}) and no other "
                                             "implementation is available") from e
                msg = f"{where} failed on first use ({err}); falling back to {nxt.impl}"
                logger.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                res.chosen = nxt.impl
                continue
            table._settle(op, cand.fn)
            return out


# An op that writes into its arguments is retried with the next candidate after a failed first call only from a
# copy of what it writes, taken before that call (on the host, so a GPU memory profile taken during the first
# step does not count it). On a GPU the first call of the cache ops runs in the memory profile's scratch cache
# (tens of MiB); a larger argument (a whole KV cache: copy_blocks' first call comes mid-serving) is not copied,
# which bounds the one-time copy to a few tens of milliseconds, and the failure is an OpFailedError as before.
SNAPSHOT_LIMIT_BYTES = 256 << 20


def _written(spec, args, kwargs) -> list[torch.Tensor] | None:
    """The tensors ``spec`` writes into in this call (a list argument counts its tensors), or None when the
    arguments do not bind to the reference's signature."""
    try:
        bound = inspect.signature(spec.reference).bind(*args, **kwargs).arguments
    except TypeError:
        return None
    out = []
    for name in spec.mutates:
        value = bound.get(name)
        out += [t for t in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(t, torch.Tensor)]
    return out


def _snapshot(spec, args, kwargs) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Host copies of what the first call may write, or None when they would exceed SNAPSHOT_LIMIT_BYTES."""
    written = _written(spec, args, kwargs)
    if written is None or sum(t.numel() * t.element_size() for t in written) > SNAPSHOT_LIMIT_BYTES:
        return None
    return [(t, t.detach().to("cpu", copy=True)) for t in written]


def _restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for t, copy in saved:
        t.copy_(copy)


def resolve(platform, policy: Policy | None = None, registry: Registry | None = None,
            ops: list[str] | None = None, tuning=None) -> OpTable:
    """Resolve every op (or ``ops``) for ``platform`` under ``policy`` (default: the platform's
    default, then ``TURNOUT_OPS``), binding the tile overrides of ``tuning`` (``turnout.envs.Envs``;
    default: the process's environment, read now, once: benchmarks/decode_step_ab.py passes
    ``envs.load(environ)`` to compare settings in one process). Raises PolicyError for a policy naming
    unknown things, and OpUnavailableError naming the op, the platform and every candidate with its reason
    if an op has no implementation (or its first choice is unavailable under a strict policy)."""
    registry = registry or default_registry()
    policy = policy or Policy.from_sources(platform=platform)
    policy.validate(registry)
    unknown = [op for op in ops or () if op not in registry.ops]
    if unknown:
        raise OpUnavailableError(f"unknown op {unknown[0]!r}; known ops: {', '.join(sorted(registry.ops))}")
    resolutions = {}
    for op in ops or sorted(registry.ops):
        res = resolve_op(op, registry, platform, policy, tuning)
        if res.error and not registry.ops[op].optional:
            raise OpUnavailableError(res.error)
        resolutions[op] = res
    return OpTable(platform, policy, resolutions, registry)


def summary_line(table: OpTable) -> str:
    """One line: how many ops, how many run on each family, and which fell back past an implementation
    the policy ranks higher (grouped by that implementation and its reason, so a library missing on this
    machine is named once, not once per op)."""
    families: dict[str, int] = {}
    fell_back: dict[tuple[str, str], list[str]] = {}
    for r in table.resolutions.values():
        family = r.chosen.split(".", 1)[0] if r.chosen else ("not needed here" if r.not_needed else "none")
        families[family] = families.get(family, 0) + 1
        for c in r.candidates:  # the tried ones come first, in policy order; the excluded ones after
            if c.impl == r.chosen or r.chosen is None:
                break
            if not c.available:
                fell_back.setdefault((c.impl, c.reason), []).append(r.op)
    counts = ", ".join(f"{n} {f}" for f, n in sorted(families.items(), key=lambda kv: (-kv[1], kv[0])))
    n = len(table.resolutions)
    line = f"op dispatch on {table.platform.name} (policy {table.policy.describe()}): {n} op{'s' * (n != 1)}, {counts}"
    ops_fell = sorted({op for group in fell_back.values() for op in group})
    if ops_fell:
        line += f"; {len(ops_fell)} fell back: " + "; ".join(
            f"{', '.join(ops)} past {impl} ({reason})" for (impl, reason), ops in fell_back.items())
    else:
        line += "; none fell back"
    missing = [r for r in table.resolutions.values() if r.chosen is None and not r.not_needed]
    if missing:  # optional ops nothing serves here, each with why (the first reason of each)
        line += "; unavailable: " + "; ".join(
            f"{r.op} ({r.candidates[0].impl}: {r.candidates[0].reason})" if r.candidates else f"{r.op} (no candidate)"
            for r in missing)
    for p in table._registry.plugins:
        if not p.loaded:
            line += f"; plugin {p.name} not loaded: {p.reason}"
    return line + " (every candidate and why: `turnout ops`, or the DEBUG log)"


def log_table(table: OpTable, log: logging.Logger = logger) -> None:
    """At start-up: one INFO line (``summary_line``); the whole table (op -> chosen -> why each other
    candidate was skipped) at DEBUG."""
    log.info("%s", summary_line(table))
    if log.isEnabledFor(logging.DEBUG):
        failed = [p for p in table._registry.plugins if not p.loaded]
        extra = "".join(f"\nplugin {p.name} not loaded: {p.reason}" for p in failed)
        log.debug("op dispatch table on %s (policy %s):\n%s%s", table.platform.name, table.policy.describe(),
                  table.format_table(), extra)
