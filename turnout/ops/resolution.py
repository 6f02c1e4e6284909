"""Resolving one op: its candidates in the policy's order, each probed, its choices bound, the first usable chosen.

Separate from the table (ops/dispatch.py) because it is a pure decision about one op that never raises:
``turnout ops`` / doctor and the conformance suite resolve single ops with it to report every candidate and
why, without building a table or touching the first-call guard.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable

from turnout import envs
from turnout.ops.kv_cache import FP8_KV_OPS, handles_fp8
from turnout.ops.policy import Policy
from turnout.ops.registry import Registry
from turnout.ops.spec import Impl


@dataclass
class Candidate:
    impl: str
    available: bool
    reason: str
    source: str = "builtin"
    fn: Callable | None = field(default=None, repr=False)
    # the implementation's declared choices as set here: [{"name", "value", "set_by", "allowed", "doc"}]
    choices: list[dict] = field(default_factory=list)


@dataclass
class Resolution:
    op: str
    chosen: str | None
    candidates: list[Candidate]  # in the order tried; then the ones the policy excludes
    error: str | None = None  # why nothing was chosen (strict policy, no candidate)
    # an optional op whose own requirement this platform does not meet (swap_layer_async without device
    # streams): nothing to serve, and nothing missing; why, in words
    not_needed: str | None = None

    def candidate(self, impl_id: str) -> Candidate:
        return next(c for c in self.candidates if c.impl == impl_id)

    def skip_reason(self, c: Candidate) -> str:
        if c.available and self.chosen is not None:
            return f"available; ranked below {self.chosen}"
        return c.reason

    def to_dict(self) -> dict:
        d = {
            "op": self.op,
            "chosen": self.chosen,
            "candidates": [{"impl": c.impl, "available": c.available, "reason": c.reason,
                            "source": c.source, **({"choices": c.choices} if c.choices else {})}
                           for c in self.candidates],
        }
        if self.error:
            d["error"] = self.error
        if self.not_needed:
            d["not_needed"] = self.not_needed
        return d


def _expand(items: tuple[str, ...], impls: list[Impl]) -> list[Impl]:
    """A per-op order: implementation ids as given, families as their members by priority."""
    by_id = {i.id: i for i in impls}
    out: list[Impl] = []
    for item in items:
        if "." in item:
            group = [by_id[item]]
        else:
            group = sorted((i for i in impls if i.family == item), key=lambda i: (-i.priority, i.id))
        out += [i for i in group if i not in out]
    return out


def _order(op: str, impls: list[Impl], platform, policy: Policy) -> tuple[list[Impl], list[tuple[Impl, str]]]:
    """Candidates in the order the policy tries them, and the ones it excludes (with why)."""
    excluded: list[tuple[Impl, str]] = []
    if op in policy.per_op:
        order = "|".join(policy.per_op[op])
        ordered = _expand(policy.per_op[op], impls)
        excluded = [(i, f"not in the policy's order for {op} ({order})") for i in impls if i not in ordered]
    else:
        families = policy.family_order(platform)
        rank = {f: n for n, f in enumerate(families)}

        # ``below`` is a default-mode ranking; under ``invariant=`` for this op only tagged implementations
        # compete, in family order (the Triton batch-invariant kernels rank below the reference otherwise)
        below_ok = op not in policy.invariant

        def place(i: Impl) -> float:  # its family's place, or just after the families it ranks below
            return max([rank.get(i.family, len(rank))] +
                       [rank.get(f, len(rank)) + 0.5 for f in i.below if below_ok])

        ordered = sorted(impls, key=lambda i: (place(i), -i.priority, i.id))
        # An implementation for another platform is no candidate here (so strict mode is about the
        # first one that could run). Named explicitly in a per-op order, it stays and is reported.
        excluded = [(i, f"does not serve platform {platform.name} (serves {i.platforms_text()})")
                    for i in ordered if not i.serves(platform)]
        ordered = [i for i in ordered if i.serves(platform)]
    kept = []
    fp8_kv = policy.kv_cache == "fp8" and op in FP8_KV_OPS
    for i in ordered:
        if op in policy.invariant and not i.batch_invariant:
            excluded.append((i, f"not batch-invariant (policy {policy.source} wants invariant {op})"))
        elif fp8_kv and not handles_fp8(i, platform)[0]:
            excluded.append((i, handles_fp8(i, platform)[1]))
        elif policy.is_denied(i.id):
            excluded.append((i, f"denied by policy ({policy.source})"))
        else:
            kept.append(i)
    return kept, excluded


def _choices(op: str, impl: Impl, policy: Policy) -> list[dict]:
    """Each declared choice of ``impl``: the value in force, who set it, and the keyword value to bind
    (None for the default: the implementation decides itself, exactly as without a policy)."""
    out = []
    for c in impl.choices:
        setting = policy.choice(op, c.name)
        value, set_by = setting if setting else (c.default, "default")
        note = ""
        if c.note is not None and value == c.default:
            try:
                note = c.note() or ""
            except Exception as e:  # a broken note must not hide the table
                note = f"note failed: {type(e).__name__}: {e}"
        out.append({"name": c.name, "value": value, "set_by": set_by, "allowed": c.allowed(), "doc": c.doc,
                    **({"note": note} if note else {}), "kwarg": c.kwarg or c.name, "bound": c.parse(value)})
    return out


def _tuned(impl: Impl, tuning) -> dict:
    """The keyword arguments ``impl.tunes`` makes of the tuning settings (tile overrides), to bind now."""
    tunes = impl.tunes
    if isinstance(tunes, str):
        module, _, attr = tunes.partition(":")
        tunes = importlib.import_module(module)
        for part in attr.split("."):
            tunes = getattr(tunes, part)
    return dict(tunes(tuning))


def _bind_fallbacks(kept: list[Impl], cands: list[Candidate]) -> None:
    """Bind, into each available implementation that ``delegates``, the next available candidate after it
    (already bound itself, so a chain of delegating implementations ends at one that serves every call).
    From the last one back, so that each binds a finished callable. Nothing after it: the calls it cannot
    serve raise, naming why, and the first-call guard falls back as for any failure."""
    nxt = None
    for impl, cand in reversed(list(zip(kept, cands))):
        if not cand.available:
            continue
        if impl.delegates:
            cand.fn = functools.partial(cand.fn, fallback=nxt or _no_fallback(impl))
        nxt = cand.fn


def _no_fallback(impl: Impl):
    def fallback(*args, **kwargs):
        raise NotImplementedError(f"{impl.id} cannot serve this call of {impl.op} and the policy leaves no "
                                  "implementation after it")
    return fallback


def resolve_op(op: str, registry: Registry, platform, policy: Policy, tuning=None) -> Resolution:
    """Probe every candidate of ``op`` (so that the table can say why each was skipped) and choose the
    first available one. Never raises for an unusable op: ``Resolution.error`` says why. ``tuning``
    (``turnout.envs.Envs``; None: the process's) holds the tile overrides bound into the implementations."""
    kept, excluded = _order(op, registry.impls[op], platform, policy)
    cands: list[Candidate] = []
    chosen = None
    requires = registry.ops[op].requires
    need_ok, need_why = True, ""
    if requires is not None:
        try:
            need_ok, need_why = requires(platform)
        except Exception as e:  # a broken requirement check makes the op unavailable, never the engine
            need_ok, need_why = False, f"requirement check raised {type(e).__name__}: {e}"
    for impl in kept:
        if not need_ok:
            cands.append(Candidate(impl.id, False, f"op {op} needs what platform {platform.name} lacks: {need_why}",
                                   impl.source))
            continue
        ok, reason, fn = impl.probe(platform)
        choices = _choices(op, impl, policy)
        bound = {}
        for c in choices:
            kwarg, value = c.pop("kwarg"), c.pop("bound")
            if value is not None:
                bound[kwarg] = value
        if ok and impl.tunes is not None:
            bound.update(_tuned(impl, envs.get() if tuning is None else tuning))
        if ok and bound:  # bound once here: the table attribute is then this partial, nothing per call
            fn = functools.partial(fn, **bound)
        cands.append(Candidate(impl.id, ok, reason, impl.source, fn, choices))
        if ok and chosen is None:
            chosen = impl.id
    _bind_fallbacks(kept, cands)
    for impl, reason in excluded:
        cands.append(Candidate(impl.id, False, reason, impl.source))
    res = Resolution(op, chosen, cands)
    where = f"op {op!r} on platform {platform.name}"
    if policy.strict and kept and not cands[0].available:
        res.chosen = None
        res.error = (f"{where}: strict policy ({policy.source}) and the first candidate {cands[0].impl} "
                     f"is unavailable: {cands[0].reason}")
    elif chosen is None and not need_ok and registry.ops[op].optional:
        res.not_needed = need_why
    elif chosen is None:
        tried = "; ".join(f"{c.impl}: {c.reason}" for c in cands) or "no implementation registered"
        res.error = f"{where} has no usable implementation (policy {policy.describe()}). Tried: {tried}"
    return res
