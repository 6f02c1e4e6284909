"""Op and implementation declarations: the op contract of DESIGN.md."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

# Names of platforms an implementation can serve; "*" means every platform.
ANY_PLATFORM = "*"
# Every platform that takes Triton kernels, by its own declaration (Platform.takes_triton: a compiled
# Triton backend, or host tensors, which only the interpreter runs). Not a list of names: a new vendor
# platform, built in or from a plugin, that says triton_backend=True gets the Triton kernels.
TRITON_PLATFORMS = "@triton"


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
    # An optional op may have no usable implementation on a platform: the table then has no attribute for
    # it (``OpTable.available`` is False; touching it raises OpUnavailableError with the reason) instead of
    # the whole resolution failing. The KV swap ops are optional: without them the engine preempts by
    # recompute. ``requires(platform) -> (ok, reason)`` is what the op itself needs of a platform (device
    # streams for an async copy): when it fails, every implementation is unavailable with that reason.
    optional: bool = False
    requires: Callable[[Any], tuple[bool, str]] | None = None

    @property
    def inplace(self) -> bool:
        return bool(self.mutates)


class ImplUnavailable(Exception):
    """Raised by a probe, a loader or a factory to say why an implementation cannot run here."""


@dataclass(frozen=True)
class Choice:
    """A decision an implementation makes inside itself (which of its kernels, how many splits), declared
    so that ``turnout ops`` shows it and the policy can fix it: ``<op>.<name>=<value>`` (docs/ops.md).

    ``default`` ("auto") means the implementation decides as it was measured to; with it nothing is bound
    and the callable is exactly the implementation's own. Any other value is passed to the callable as
    the keyword ``kwarg`` (default: ``name``), bound once at resolution (never a per-call lookup).
    ``values`` lists the allowed values; ``integer=True`` allows instead any integer in
    ``[minimum, maximum]``. ``doc`` says what the default does; ``note``, if given, is a zero-argument
    function returning what else sets the default on this machine (a tuning variable), or "".
    """

    name: str
    doc: str
    values: tuple[str, ...] = ()
    integer: bool = False
    minimum: int = 1
    maximum: int | None = None
    default: str = "auto"
    kwarg: str | None = None
    note: Callable[[], str] | None = None

    def allowed(self) -> str:
        if self.integer:
            top = "" if self.maximum is None else f"..{self.maximum}"
            return f"{self.default} or an integer {self.minimum}{top}" if top else \
                f"{self.default} or an integer >= {self.minimum}"
        return "|".join((self.default,) + tuple(self.values))

    def parse(self, text: str):
        """The value to bind for ``text`` (None for the default); ValueError saying what is allowed."""
        if text == self.default:
            return None
        if self.integer:
            try:
                value = int(text)
            except ValueError:
                value = None
            if value is None or value < self.minimum or (self.maximum is not None and value > self.maximum):
                raise ValueError(f"must be {self.allowed()}, got {text!r}")
            return value
        if text not in self.values:
            raise ValueError(f"must be one of {self.allowed()}, got {text!r}")
        return text


# Families, in the default order a GPU platform tries them. Every implementation id starts with one.
KNOWN_FAMILIES = ("vendor", "triton", "reference")

# An id is used inside the policy grammar, so it may not contain its separators (; = | , space).
_ID_RE = re.compile(r"^[A-Za-z0-9_]+\.[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_CHOICE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _always(*shape) -> bool:
    return True


def _describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class Impl:
    """An implementation of an op.

    ``id`` is ``<family>.<name>`` (``reference.torch``, ``triton.default``, ``vendor.cuda``) with
    family one of KNOWN_FAMILIES. ``target`` is a callable or ``"module:attr"`` where ``attr`` may be
    dotted (``"torch.ops:_C.rms_norm"``); the module is imported only when probed, so a vendor module
    that fails to import disables only the implementations that name it. With ``factory=True`` the
    target is a zero-argument function that returns the real callable (or raises ImplUnavailable):
    the way to bind into lazy namespaces such as ``torch.ops.<lib>``, on which ``hasattr`` is always
    true. ``check(platform)`` may add a capability test returning ``(ok, reason)``; it runs
    after the callable resolved.

    ``below`` names families this implementation is tried after in the family order (``prefer`` included),
    for one that is not yet measured to beat them: ``vendor.cuda`` moe_experts ranks below ``triton``.
    A per-op order in the policy places it anywhere. ``choices`` declares the decisions it makes inside
    itself (``Choice``): shown by ``turnout ops``, fixed by ``<op>.<choice>=<value>`` in the policy.

    ``pays`` is the implementation's own claim that a model should route its decode path through it, for
    the ops that replace a chain of unfused ops (``small_m_linear``, ``add_rms_norm_linear``,
    ``rotary_paged_attention``; the fusion plan, turnout/layers/fusion.py, reads it). None (the default):
    no claim, the model keeps the unfused chain. True: always. A predicate (a callable or ``"module:attr"``,
    resolved like ``target`` when the plan is built) over the shape the fusion is for, e.g. ``(N, K)`` of a
    projection for ``add_rms_norm_linear``.

    ``tunes`` (a callable or ``"module:attr"``) turns the resolution's tuning settings (``turnout.envs.Envs``:
    tile overrides) into keyword arguments bound into the implementation when the op table is resolved, so a
    kernel never reads them from a process global when it launches (turnout/ops/triton/_tuning.py).
    """

    op: str
    id: str
    target: str | Callable
    platforms: tuple[str, ...] = (ANY_PLATFORM,)
    priority: int = 0
    check: Callable[[Any], tuple[bool, str]] | None = None
    source: str = "builtin"  # "builtin" or "plugin:<name>"
    factory: bool = False
    below: tuple[str, ...] = ()
    choices: tuple[Choice, ...] = ()
    pays: bool | str | Callable[..., bool] | None = None
    tunes: str | Callable[[Any], dict] | None = None
    # A row's result is bitwise the same whatever else is in the call (rows, their number, the query chunk):
    # only such implementations serve an op the policy lists under ``invariant=`` (batch-invariant mode,
    # turnout/ops/batch_invariant.py); tests/ops/test_batch_invariant_ops.py holds them to it.
    batch_invariant: bool = False
    # For the ops that read or write the KV cache (turnout/ops/kv_cache.py: FP8_KV_OPS): whether it handles an
    # fp8 (e4m3fn) cache with k_scale / v_scale; True, or a check(platform) -> (ok, why). Under kv_cache=fp8
    # only those serve (the reference always does).
    kv_fp8: bool | Callable[[Any], tuple[bool, str]] = False
    # An implementation that serves only some call shapes (a library kernel without float32, without a sink
    # logit, ...) declares ``delegates=True`` and takes a keyword ``fallback``: the resolution binds there the
    # next available candidate in the policy's order (functools.partial, once), so a call it cannot serve
    # goes where the policy would have sent the whole op, and every other call pays only its own shape test.
    delegates: bool = False

    def __post_init__(self):
        if not isinstance(self.id, str) or not _ID_RE.match(self.id):
            raise ValueError(f"implementation id {self.id!r} of op {self.op!r} must be '<family>.<name>' "
                             "(letters, digits, '_', '-', '.')")
        if self.family not in KNOWN_FAMILIES:
            raise ValueError(f"implementation {self.id!r} of op {self.op!r}: unknown family {self.family!r} "
                             f"(families: {', '.join(KNOWN_FAMILIES)})")
        if isinstance(self.platforms, str):  # a common slip: platforms="cuda"
            object.__setattr__(self, "platforms", (self.platforms,))
        if isinstance(self.below, str):
            object.__setattr__(self, "below", (self.below,))
        bad = [f for f in self.below if f not in KNOWN_FAMILIES]
        if bad:
            raise ValueError(f"implementation {self.id!r} of op {self.op!r}: below names unknown family {bad[0]!r} "
                             f"(families: {', '.join(KNOWN_FAMILIES)})")
        names = [c.name for c in self.choices]
        if len(set(names)) != len(names) or not all(_CHOICE_RE.match(n) for n in names):
            raise ValueError(f"implementation {self.id!r} of op {self.op!r}: choice names {names} must be distinct "
                             "identifiers")
        if not callable(self.target):
            module, sep, attr = str(self.target).partition(":")
            if not sep or not module or not attr:
                raise ValueError(f"implementation {self.id!r} of op {self.op!r}: target {self.target!r} "
                                 "must be a callable or 'module:attr'")
        if isinstance(self.tunes, str) and not all(self.tunes.partition(":")[::2]):
            raise ValueError(f"implementation {self.id!r} of op {self.op!r}: tunes {self.tunes!r} must be a "
                             "callable or 'module:attr'")
        if isinstance(self.pays, str) and not all(self.pays.partition(":")[::2]):
            raise ValueError(f"implementation {self.id!r} of op {self.op!r}: pays {self.pays!r} must be a bool, "
                             "a callable or 'module:attr'")

    @property
    def family(self) -> str:
        return self.id.split(".", 1)[0]

    @property
    def module(self) -> str | None:
        """The module a string target imports (None for a callable target)."""
        return None if callable(self.target) else self.target.partition(":")[0]

    def serves(self, platform) -> bool:
        if ANY_PLATFORM in self.platforms or platform.name in self.platforms:
            return True
        return TRITON_PLATFORMS in self.platforms and bool(getattr(platform, "takes_triton", False))

    def platforms_text(self) -> str:
        """The platforms it serves, in words (for "does not serve" reasons)."""
        names = ["platforms that take Triton kernels" if p == TRITON_PLATFORMS else p for p in self.platforms]
        return ",".join(names)

    def pays_predicate(self) -> Callable[..., bool] | None:
        """The ``pays`` claim as a predicate (None: no claim); raises ImplUnavailable if it does not import."""
        if self.pays is None or self.pays is False:
            return None
        if self.pays is True:
            return _always
        if callable(self.pays):
            return self.pays
        module, _, attr = self.pays.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as e:
            raise ImplUnavailable(f"pays predicate {self.pays!r} of {self.id} did not resolve: "
                                  f"{_describe_error(e)}") from e
        if not callable(obj):
            raise ImplUnavailable(f"pays predicate {self.pays!r} of {self.id} is a {type(obj).__name__}")
        return obj

    def resolve(self) -> Callable:
        """Import and return the real callable; raises ImplUnavailable with the reason."""
        if callable(self.target):
            fn = self.target
        else:
            module, _, attr = self.target.partition(":")
            try:
                obj = importlib.import_module(module)
            except (Exception, SystemExit) as e:  # any failure of the module disables only this impl
                raise ImplUnavailable(f"import {module} failed: {_describe_error(e)}") from e
            where = module
            for part in attr.split("."):
                try:
                    # Not hasattr: lazy namespaces (torch.ops.X) answer any name; only fetching the
                    # attribute for real tells whether the op exists (and they raise RuntimeError too).
                    obj = getattr(obj, part)
                except Exception as e:
                    raise ImplUnavailable(f"{where} has no attribute {part!r} ({_describe_error(e)})") from e
                where = f"{where}.{part}"
            fn = obj
        if self.factory:
            try:
                fn = fn()
            except ImplUnavailable:
                raise
            except Exception as e:
                raise ImplUnavailable(f"loader {self.target!r} failed: {_describe_error(e)}") from e
        if fn is None or not callable(fn):
            raise ImplUnavailable(f"{self.target!r} resolved to {type(fn).__name__}, not a callable")
        return fn

    def probe(self, platform) -> tuple[bool, str, Callable | None]:
        """(available, reason, callable). Resolves the callable for real (a lazy namespace has every name)."""
        if not self.serves(platform):
            return False, f"does not serve platform {platform.name} (serves {self.platforms_text()})", None
        try:
            fn = self.resolve()
        except ImplUnavailable as e:
            return False, str(e), None
        if self.check is not None:
            try:
                ok, why = self.check(platform)
            except Exception as e:
                ok, why = False, f"capability check raised {_describe_error(e)}"
            if not ok:
                return False, why or "capability check failed", None
        return True, "available", fn
