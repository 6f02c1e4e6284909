"""Resolve every op once, at engine start, into a frozen table of callables.

After resolution, ``table.rms_norm(...)`` is a plain attribute lookup of the chosen callable. Only the
first call of each op goes through a guard that implements fallback: an implementation that raises on
first use is marked failed and the next available candidate is used (never for an op that writes into
its arguments, which may have been partly written; never in strict mode).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Callable

from turnout.ops.policy import Policy
from turnout.ops.registry import Registry, default_registry
from turnout.ops.spec import Impl

logger = logging.getLogger(__name__)


class OpUnavailableError(RuntimeError):
    """No implementation of an op can run on this platform under this policy."""


class OpFailedError(RuntimeError):
    """An implementation failed on first use and fallback was not allowed."""


@dataclass
class Candidate:
    impl: str
    available: bool
    reason: str
    source: str = "builtin"
    fn: Callable | None = field(default=None, repr=False)


@dataclass
class Resolution:
    op: str
    chosen: str | None
    candidates: list[Candidate]  # in policy order; then the ones that do not apply

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "chosen": self.chosen,
            "candidates": [{"impl": c.impl, "available": c.available, "reason": c.reason,
                            "source": c.source} for c in self.candidates],
        }


def _order(op: str, impls: list[Impl], platform, policy: Policy) -> tuple[list[Impl], list[tuple[Impl, str]]]:
    """Candidates in the order the policy tries them, and the ones it excludes (with why)."""
    excluded: list[tuple[Impl, str]] = []
    if op in policy.per_op:
        by_id = {i.id: i for i in impls}
        ordered = [by_id[i] for i in policy.per_op[op]]
        excluded = [(i, f"not in policy order for {op} ({'|'.join(policy.per_op[op])})")
                    for i in impls if i.id not in policy.per_op[op]]
    else:
        families = policy.family_order(platform)
        rank = {f: n for n, f in enumerate(families)}
        ordered = sorted(impls, key=lambda i: (rank.get(i.family, len(rank)), -i.priority, i.id))
    kept = []
    for i in ordered:
        if policy.is_denied(i.id):
            excluded.append((i, f"denied by policy ({policy.source})"))
        else:
            kept.append(i)
    return kept, excluded


def resolve_op(op: str, registry: Registry, platform, policy: Policy) -> Resolution:
    kept, excluded = _order(op, registry.impls[op], platform, policy)
    cands: list[Candidate] = []
    chosen = None
    for impl in kept:
        ok, reason, fn = impl.probe(platform)
        cands.append(Candidate(impl.id, ok, reason, impl.source, fn))
        if ok and chosen is None:
            chosen = impl.id
    for impl, reason in excluded:
        cands.append(Candidate(impl.id, False, reason, impl.source))
    if chosen is not None and policy.strict and kept and chosen != kept[0].id:
        first = cands[0]
        raise OpUnavailableError(
            f"op {op!r} on platform {platform.name}: strict policy ({policy.source}) and the first "
            f"candidate {first.impl} is unavailable: {first.reason}")
    return Resolution(op, chosen, cands)


class OpTable:
    """The frozen op table an engine runs with. One attribute per op."""

    def __init__(self, platform, policy: Policy, resolutions: dict[str, Resolution], registry: Registry):
        self.platform = platform
        self.policy = policy
        self.resolutions = resolutions
        self._registry = registry
        for op, res in resolutions.items():
            object.__setattr__(self, op, _FirstCallGuard(self, op))

    def __setattr__(self, name, value):
        if hasattr(self, "resolutions") and name in self.resolutions:
            raise AttributeError(f"the op table is frozen; {name!r} cannot be reassigned")
        object.__setattr__(self, name, value)

    def _settle(self, op: str, fn: Callable) -> None:
        object.__setattr__(self, op, fn)

    def chosen(self, op: str) -> str | None:
        return self.resolutions[op].chosen

    def report(self) -> list[dict]:
        return [r.to_dict() for r in self.resolutions.values()]

    def format_table(self) -> str:
        rows = [("op", "chosen", "skipped (why)")]
        for r in self.resolutions.values():
            skipped = "; ".join(f"{c.impl}: {c.reason}" for c in r.candidates
                                if c.impl != r.chosen and not (c.available and r.chosen is None))
            rows.append((r.op, r.chosen or "-", skipped or "-"))
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        return "\n".join(f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)


class _FirstCallGuard:
    """Runs an op's first call; on success the table points straight at the callable."""

    def __init__(self, table: OpTable, op: str):
        self.table = table
        self.op = op

    def __call__(self, *args, **kwargs):
        table, op = self.table, self.op
        res = table.resolutions[op]
        spec = table._registry.ops[op]
        while True:
            cand = next(c for c in res.candidates if c.impl == res.chosen)
            try:
                out = cand.fn(*args, **kwargs)
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
                cand.available, cand.reason = False, f"failed on first use: {err}"
                nxt = next((c for c in res.candidates if c.available), None)
                where = f"op {op!r} implementation {cand.impl} on platform {table.platform.name}"
                if table.policy.strict:
                    raise OpFailedError(f"{where} failed on first use and the policy is strict: {err}") from e
                if spec.inplace:
                    raise OpFailedError(
                        f"{where} failed on first use: {err}. Not retried with another implementation "
                        f"because the op writes into {', '.join(spec.mutates)}, which may be partly written; "
                        f"deny it with TURNOUT_OPS='deny={cand.impl}'") from e
                if nxt is None:
                    raise OpUnavailableError(f"{where} failed on first use ({err}) and no other "
                                             f"implementation is available") from e
                msg = f"{where} failed on first use ({err}); falling back to {nxt.impl}"
                logger.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
                res.chosen = nxt.impl
                continue
            table._settle(op, cand.fn)
            return out


def resolve(platform, policy: Policy | None = None, registry: Registry | None = None,
            ops: list[str] | None = None) -> OpTable:
    """Resolve every op (or ``ops``) for ``platform`` under ``policy``. Raises OpUnavailableError
    naming the op, the platform and every candidate with its reason if an op has no implementation."""
    registry = registry or default_registry()
    policy = policy or Policy.from_sources()
    policy.validate(registry)
    resolutions = {}
    for op in ops or sorted(registry.ops):
        res = resolve_op(op, registry, platform, policy)
        if res.chosen is None:
            tried = "; ".join(f"{c.impl}: {c.reason}" for c in res.candidates) or "no implementation registered"
            raise OpUnavailableError(f"op {op!r} has no usable implementation on platform {platform.name} "
                                     f"(policy {policy.describe()}). Tried: {tried}")
        resolutions[op] = res
    return OpTable(platform, policy, resolutions, registry)


def log_table(table: OpTable, log: logging.Logger = logger) -> None:
    log.info("op dispatch on %s (policy %s):\n%s", table.platform.name, table.policy.describe(),
             table.format_table())
    for p in table._registry.plugins:
        if not p.loaded:
            log.warning("ops plugin %s not loaded: %s", p.name, p.reason)
