"""The registry of ops and their implementations (built-in and from plugins)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from importlib import metadata

from turnout.ops.spec import Impl, OpSpec

logger = logging.getLogger(__name__)

OPS_ENTRY_POINT_GROUP = "turnout.ops"


@dataclass(frozen=True)
class PluginReport:
    """How one source of implementations loaded: a ``turnout.ops`` entry point ("fakechip") or a
    built-in registration module ("builtin:turnout.ops.vendors.cuda")."""

    name: str
    loaded: bool
    reason: str
    value: str = ""  # the entry point's "module:attr"


class Registry:
    def __init__(self):
        self.ops: dict[str, OpSpec] = {}
        self.impls: dict[str, list[Impl]] = {}
        self.plugins: list[PluginReport] = []

    def add_op(self, spec: OpSpec) -> None:
        if spec.name in self.ops:
            raise ValueError(f"op {spec.name!r} is declared twice")
        self.ops[spec.name] = spec
        self.impls.setdefault(spec.name, [])
        # The reference is an implementation like the others, on every platform.
        self.add_impl(Impl(op=spec.name, id="reference.torch", target=spec.reference, priority=-1000))

    def add_impl(self, impl: Impl) -> None:
        if impl.op not in self.ops:
            raise ValueError(f"implementation {impl.id!r} registered for unknown op {impl.op!r}; "
                             f"known ops: {', '.join(sorted(self.ops))}")
        if any(i.id == impl.id for i in self.impls[impl.op]):
            raise ValueError(f"op {impl.op!r} already has an implementation {impl.id!r}")
        self.impls[impl.op].append(impl)

    def impl_ids(self, op: str | None = None) -> set[str]:
        lists = [self.impls[op]] if op else self.impls.values()
        return {i.id for lst in lists for i in lst}

    def get_impl(self, op: str, impl_id: str) -> Impl:
        for i in self.impls[op]:
            if i.id == impl_id:
                return i
        raise KeyError(f"op {op!r} has no implementation {impl_id!r}")

    def run_registration(self, name: str, register, source: str = "builtin", value: str = "") -> bool:
        """Call ``register(view)``; its implementations are added all together or not at all.

        A registration that raises is recorded in ``plugins`` with its reason and skipped: one broken
        vendor or plugin never stops the engine.
        """
        view = _RegistrationView(self, source)
        try:
            register(view)
            view._commit()
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            logger.warning("op implementations from %s not registered: %s", name, reason)
            self.plugins.append(PluginReport(name, False, reason, value))
            return False
        if source != "builtin":
            self.plugins.append(PluginReport(name, True, f"registered {len(view._pending)} implementation(s)",
                                             value))
        return True

    def load_plugins(self) -> None:
        """Entry points of group ``turnout.ops``: each loads to ``register(registry)``.

        A plugin that fails to import or to register is recorded with its reason and skipped.
        """
        try:
            eps = list(metadata.entry_points(group=OPS_ENTRY_POINT_GROUP))
        except Exception as e:  # a corrupt installed distribution must not stop the engine either
            self.plugins.append(PluginReport(f"<{OPS_ENTRY_POINT_GROUP} entry points>", False,
                                             f"cannot list entry points: {type(e).__name__}: {e}"))
            return
        for ep in eps:
            try:
                register = ep.load()
            except (Exception, SystemExit) as e:
                reason = f"{type(e).__name__}: {e}"
                logger.warning("ops plugin %r (%s) failed to load and is skipped: %s", ep.name, ep.value, reason)
                self.plugins.append(PluginReport(ep.name, False, reason, ep.value))
                continue
            if not callable(register):
                self.plugins.append(PluginReport(ep.name, False, f"{ep.value} is not callable", ep.value))
                continue
            self.run_registration(ep.name, register, source=f"plugin:{ep.name}", value=ep.value)


class _RegistrationView:
    """What a ``register`` function receives: it reads ``ops`` and adds implementations, which are
    tagged with their source and committed only if ``register`` returns normally."""

    def __init__(self, registry: Registry, source: str):
        self._registry = registry
        self._source = source
        self._pending: list[Impl] = []
        self.ops = registry.ops

    def add_impl(self, impl: Impl) -> None:
        if not isinstance(impl, Impl):
            raise TypeError(f"add_impl expects an Impl, got {type(impl).__name__}")
        impl = replace(impl, source=self._source)
        if impl.op not in self._registry.ops:
            raise ValueError(f"implementation {impl.id!r} registered for unknown op {impl.op!r}; "
                             f"known ops: {', '.join(sorted(self._registry.ops))}")
        taken = self._registry.impl_ids(impl.op) | {i.id for i in self._pending if i.op == impl.op}
        if impl.id in taken:
            raise ValueError(f"op {impl.op!r} already has an implementation {impl.id!r}")
        self._pending.append(impl)

    def _commit(self) -> None:
        for impl in self._pending:
            self._registry.add_impl(impl)


_default: Registry | None = None
_lock = threading.Lock()


def build_registry(plugins: bool = True) -> Registry:
    """A fresh registry with every built-in op and implementation (and plugins, unless disabled)."""
    from turnout.ops import batch_invariant, reference, vendors

    reg = Registry()
    for spec in reference.all_specs() + batch_invariant.specs():
        reg.add_op(spec)

    def triton_register(view):
        from turnout.ops import triton as triton_impls

        triton_impls.register(view)

    reg.run_registration("builtin:turnout.ops.triton", triton_register)
    reg.run_registration("builtin:turnout.ops.batch_invariant", batch_invariant.register)
    vendors.register(reg)
    if plugins:
        reg.load_plugins()
    return reg


def default_registry() -> Registry:
    """The process-wide registry, built on first use (plugins are scanned once)."""
    global _default
    with _lock:
        if _default is None:
            _default = build_registry()
        return _default
