"""The registry of ops and their implementations (built-in and from plugins)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from importlib import metadata

from turnout.ops.spec import Impl, OpSpec

logger = logging.getLogger(__name__)

OPS_ENTRY_POINT_GROUP = "turnout.ops"


@dataclass(frozen=True)
class PluginReport:
    name: str
    loaded: bool
    reason: str


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
            raise ValueError(f"implementation {impl.id!r} registered for unknown op {impl.op!r}")
        if any(i.id == impl.id for i in self.impls[impl.op]):
            raise ValueError(f"op {impl.op!r} already has an implementation {impl.id!r}")
        self.impls[impl.op].append(impl)

    def impl_ids(self, op: str | None = None) -> set[str]:
        lists = [self.impls[op]] if op else self.impls.values()
        return {i.id for lst in lists for i in lst}

    def load_plugins(self) -> None:
        """Entry points of group ``turnout.ops``: each loads to ``register(registry)``.

        A plugin that fails to import or to register is recorded with its reason and skipped.
        """
        for ep in metadata.entry_points(group=OPS_ENTRY_POINT_GROUP):
            try:
                register = ep.load()
                before = {op: len(v) for op, v in self.impls.items()}
                register(_PluginView(self, f"plugin:{ep.name}"))
                added = sum(len(v) - before.get(op, 0) for op, v in self.impls.items())
                self.plugins.append(PluginReport(ep.name, True, f"registered {added} implementation(s)"))
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
                logger.warning("ops plugin %r failed to load and is skipped: %s", ep.name, reason)
                self.plugins.append(PluginReport(ep.name, False, reason))


class _PluginView:
    """What a plugin's ``register`` receives: it can add implementations, tagged with their source."""

    def __init__(self, registry: Registry, source: str):
        self._registry = registry
        self._source = source
        self.ops = registry.ops

    def add_impl(self, impl: Impl) -> None:
        from dataclasses import replace

        self._registry.add_impl(replace(impl, source=self._source))


_default: Registry | None = None
_lock = threading.Lock()


def build_registry(plugins: bool = True) -> Registry:
    """A fresh registry with every built-in op and implementation (and plugins)."""
    from turnout.ops import reference, triton as triton_impls, vendors

    reg = Registry()
    for spec in reference.all_specs():
        reg.add_op(spec)
    triton_impls.register(reg)
    vendors.register(reg)
    if plugins:
        reg.load_plugins()
    return reg


def default_registry() -> Registry:
    global _default
    with _lock:
        if _default is None:
            _default = build_registry()
        return _default
