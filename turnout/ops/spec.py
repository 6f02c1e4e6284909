"""Op and implementation declarations: the op contract of DESIGN.md."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

# Names of platforms an implementation can serve; "*" means every platform.
ANY_PLATFORM = "*"


@dataclass
class SampleCase:
    """One valid input of an op, for the conformance suite."""

    label: str
    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OpSpec:
    """An op, declared once.

    ``reference`` is the PyTorch implementation that defines what the op means. ``mutates`` names the
    arguments the op writes into (empty: a pure function returning its result). ``tolerance`` maps a
    dtype name ("float32", "float16", "bfloat16") to ``(atol, rtol)``. ``sample_inputs(device, dtype,
    generator)`` yields SampleCases; ``dtypes`` lists the dtypes the suite runs. ``compare`` replaces
    the default tensor comparison when an op needs its own (it returns (ok, max_error, message)).
    """

    name: str
    reference: Callable
    sample_inputs: Callable[[Any, Any, Any], Iterable[SampleCase]]
    mutates: tuple[str, ...] = ()
    tolerance: dict[str, tuple[float, float]] = field(
        default_factory=lambda: {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}
    )
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    compare: Callable | None = None
    doc: str = ""

    @property
    def inplace(self) -> bool:
        return bool(self.mutates)


class ImplUnavailable(Exception):
    """Raised by a probe or loader to say why an implementation cannot run here."""


@dataclass(frozen=True)
class Impl:
    """An implementation of an op.

    ``id`` is ``<family>.<name>`` (``reference.torch``, ``triton.default``, ``vendor.cuda``).
    ``target`` is ``"module:attr"``, imported only when probed (so a vendor module that fails to
    import disables only the implementations that need it), or a callable. ``check(platform)`` may
    add a capability test returning ``(ok, reason)``; it runs after the callable resolved.
    """

    op: str
    id: str
    target: str | Callable
    platforms: tuple[str, ...] = (ANY_PLATFORM,)
    priority: int = 0
    check: Callable[[Any], tuple[bool, str]] | None = None
    source: str = "builtin"  # "builtin" or "plugin:<name>"

    def __post_init__(self):
        fam, sep, name = self.id.partition(".")
        if not sep or not fam or not name:
            raise ValueError(f"implementation id {self.id!r} of op {self.op!r} must be '<family>.<name>'")

    @property
    def family(self) -> str:
        return self.id.split(".", 1)[0]

    def serves(self, platform) -> bool:
        return ANY_PLATFORM in self.platforms or platform.name in self.platforms

    def resolve(self) -> Callable:
        """Import and return the real callable; raises ImplUnavailable with the reason."""
        if callable(self.target):
            return self.target
        module, _, attr = self.target.partition(":")
        try:
            mod = importlib.import_module(module)
        except Exception as e:
            raise ImplUnavailable(f"import {module} failed: {type(e).__name__}: {e}") from e
        try:
            fn = getattr(mod, attr)
        except AttributeError as e:
            raise ImplUnavailable(f"{module} has no attribute {attr!r}") from e
        if not callable(fn):
            raise ImplUnavailable(f"{module}.{attr} is {type(fn).__name__}, not callable")
        return fn

    def probe(self, platform) -> tuple[bool, str, Callable | None]:
        """(available, reason, callable). Resolves the callable for real (seed 003)."""
        if not self.serves(platform):
            return False, f"does not serve platform {platform.name} (serves {','.join(self.platforms)})", None
        try:
            fn = self.resolve()
        except ImplUnavailable as e:
            return False, str(e), None
        if self.check is not None:
            try:
                ok, why = self.check(platform)
            except Exception as e:
                ok, why = False, f"capability check raised {type(e).__name__}: {e}"
            if not ok:
                return False, why, None
        return True, "available", fn
