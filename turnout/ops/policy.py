"""The op policy: which implementation families to prefer, per-op orders, a deny list, strict mode.

Grammar (clauses separated by ';', whitespace around names ignored, each key at most once a string)::

    prefer=<family>|<family>...     families first, in this order; the others follow in platform order
    <op>=<impl or family>|...       exactly these candidates for this op, in this order (a family
                                    stands for its implementations, highest priority first)
    deny=<impl id or family>,...    never use these ("vendor.cuda", or a whole family "vendor")
    strict=0|1                      1: no fallback; an unavailable or failing first choice is an error
    invariant=<op>,...|all          only implementations tagged ``batch_invariant`` serve these ops (batch-
                                    invariant mode; "all": every op the mode needs, turnout/ops/batch_invariant.py);
                                    an op none serves here is a start-up error naming the op and what was tried
    kv_cache=auto|fp8               fp8: the KV cache is float8_e4m3fn; only implementations declaring
                                    ``kv_fp8`` serve the ops that touch it (turnout/ops/kv_cache.py)
    <op>.<choice>=<value>           fix a decision an implementation makes inside itself (``Choice``),
                                    e.g. ``moe_experts.kernel=grouped``, ``paged_attention.num_splits=1``;
                                    ``auto`` is the implementation's own (measured) decision

Lists take '|' or ','. Example: ``rms_norm=triton.default|reference.torch;deny=vendor.cuda;strict=1``.

Layers, each on top of the one before: the platform's default (``Platform.ops_policy``), the engine
config's ``ops_policy``, then ``TURNOUT_OPS``. A later layer replaces ``prefer``, ``strict`` and the
order of each op it names, and each choice it sets; ``deny`` and ``invariant`` lists add up. The engine's
``batch_invariant`` setting is one more layer, ``invariant=all``, on top (``Policy.for_config``), and its
``kv_cache_dtype`` one more, ``kv_cache=<dtype>``. Read once, at engine start;
never in a hot path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from turnout import envs
from turnout.ops.spec import KNOWN_FAMILIES

ENV_VAR = "TURNOUT_OPS"
RESERVED_KEYS = ("prefer", "deny", "strict", "invariant", "kv_cache")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class PolicyError(ValueError):
    """A malformed policy string, or one naming an unknown op, implementation or family."""


@dataclass(frozen=True)
class Policy:
    prefer: tuple[str, ...] = ()
    per_op: dict[str, tuple[str, ...]] = field(default_factory=dict)
    deny: frozenset[str] = frozenset()
    strict: bool = False
    source: str = "default"
    # op -> choice name -> (value as written, the layer that set it)
    choices: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    invariant: frozenset[str] = frozenset()  # ops only batch-invariant implementations may serve
    kv_cache: str = "auto"  # the KV cache's dtype: "fp8" narrows the cache ops' candidates (kv_cache.py)

    @property
    def batch_invariant(self) -> bool:
        """Whether this is the batch-invariant mode (every op it needs is listed): the model then takes
        every projection through the ``linear`` op and no decode fusion (turnout/layers/fusion.py)."""
        from turnout.ops.batch_invariant import INVARIANT_OPS

        return set(INVARIANT_OPS) <= self.invariant

    @classmethod
    def parse(cls, text: str | None, source: str = "string", base: "Policy | None" = None) -> "Policy":
        """Parse ``text`` on top of ``base``. Raises PolicyError naming the source and the clause."""
        pol = base or cls()
        prefer, per_op, deny, strict = pol.prefer, dict(pol.per_op), set(pol.deny), pol.strict
        invariant = set(pol.invariant)
        kv_cache = pol.kv_cache
        choices = {op: dict(c) for op, c in pol.choices.items()}
        seen: set[str] = set()
        for raw in (text or "").split(";"):
            clause = raw.strip()
            if not clause:
                continue
            key, sep, value = clause.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key or not value:
                raise PolicyError(f"{source}: clause {clause!r} is not 'key=value' "
                                  f"(keys: prefer, deny, strict, an op name, or <op>.<choice>)")
            if not _NAME_RE.match(key):
                raise PolicyError(f"{source}: {key!r} in {clause!r} is not a valid key")
            if key in seen:
                raise PolicyError(f"{source}: {key!r} is given twice")
            seen.add(key)
            if key == "strict":
                low = value.lower()
                if low not in _TRUE + _FALSE:
                    raise PolicyError(f"{source}: strict must be 0 or 1, got {value!r}")
                strict = low in _TRUE
                continue
            if key == "kv_cache":
                if value not in ("auto", "fp8"):
                    raise PolicyError(f"{source}: kv_cache must be auto or fp8, got {value!r}")
                kv_cache = value
                continue
            if key == "invariant":
                from turnout.ops.batch_invariant import INVARIANT_OPS

                names = [v.strip() for v in re.split(r"[|,]", value)]
                if any(not v or not _NAME_RE.match(v) or "." in v for v in names):
                    raise PolicyError(f"{source}: {clause!r} must list op names or 'all' (invariant=linear,sample)")
                invariant |= set(INVARIANT_OPS) if names == ["all"] else set(names)
                continue
            if "." in key:  # <op>.<choice>=<value>: one value, checked against the declaration in validate()
                op, _, name = key.partition(".")
                if not op or not name or "." in name or not _NAME_RE.match(value) or re.search(r"[|,]", value):
                    raise PolicyError(f"{source}: {clause!r} must be '<op>.<choice>=<value>' with one value "
                                      "(e.g. moe_experts.kernel=grouped)")
                choices.setdefault(op, {})[name] = (value, source)
                continue
            items = tuple(v.strip() for v in re.split(r"[|,]", value))
            if any(not v for v in items):
                raise PolicyError(f"{source}: empty name in {clause!r}")
            bad = [v for v in items if not _NAME_RE.match(v)]
            if bad:
                raise PolicyError(f"{source}: {bad[0]!r} in {clause!r} is not an implementation id or family")
            dup = sorted({v for v in items if items.count(v) > 1})
            if dup:
                raise PolicyError(f"{source}: {dup[0]!r} is listed twice in {clause!r}")
            for v in items:  # a bare name must be a family; a dotted one is an id, checked in validate()
                if "." not in v and v not in KNOWN_FAMILIES:
                    raise PolicyError(f"{source}: unknown family {v!r} in {clause!r} "
                                      f"(families: {', '.join(KNOWN_FAMILIES)}; implementations are "
                                      "'<family>.<name>')")
                if "." in v and v.split(".", 1)[0] not in KNOWN_FAMILIES:
                    raise PolicyError(f"{source}: {v!r} in {clause!r} has unknown family "
                                      f"{v.split('.', 1)[0]!r} (families: {', '.join(KNOWN_FAMILIES)})")
            if key == "prefer":
                ids = [v for v in items if "." in v]
                if ids:
                    raise PolicyError(f"{source}: prefer takes families ({', '.join(KNOWN_FAMILIES)}), "
                                      f"not implementation {ids[0]!r}; to order one op use '<op>={ids[0]}|...'")
                prefer = items
            elif key == "deny":
                deny |= set(items)
            else:
                per_op[key] = items
        src = source if pol.source == "default" else f"{pol.source}+{source}"
        return replace(pol, prefer=prefer, per_op=per_op, deny=frozenset(deny), strict=strict, source=src,
                       choices=choices, invariant=frozenset(invariant), kv_cache=kv_cache)

    @classmethod
    def from_sources(cls, config_text: str | None = None, env: dict | None = None,
                     platform=None) -> "Policy":
        """Platform default, then the engine config's policy, then ``TURNOUT_OPS``. Read once."""
        env_text = envs.get().ops if env is None else env.get(ENV_VAR)
        pol = cls()
        default_text = getattr(platform, "ops_policy", "") if platform is not None else ""
        if default_text:
            pol = cls.parse(default_text, source=f"platform {platform.name} default", base=pol)
        if config_text:
            pol = cls.parse(config_text, source="ops_policy", base=pol)
        if env_text and env_text.strip():
            pol = cls.parse(env_text, source=ENV_VAR, base=pol)
        return pol

    @classmethod
    def for_config(cls, config, platform=None, env: dict | None = None) -> "Policy":
        """The policy an engine with ``config`` runs: ``from_sources``, then, with ``config.batch_invariant``,
        ``invariant=all`` on top (so no layer below can take the mode back)."""
        pol = cls.from_sources(config.ops_policy, env=env, platform=platform)
        if getattr(config, "batch_invariant", False):
            pol = cls.parse("invariant=all", source="batch_invariant", base=pol)
        if getattr(config, "kv_cache_dtype", "auto") != "auto":
            pol = cls.parse(f"kv_cache={config.kv_cache_dtype}", source="kv_cache_dtype", base=pol)
        return pol

    def validate(self, registry) -> None:
        """Unknown op or implementation names are errors at start-up, not silently ignored."""
        all_ids = registry.impl_ids()
        for op in sorted(self.invariant):
            if op not in registry.ops:
                raise PolicyError(f"policy ({self.source}) wants unknown op {op!r} batch-invariant; "
                                  f"known ops: {', '.join(sorted(registry.ops))}")
        for op, items in self.per_op.items():
            if op not in registry.ops:
                raise PolicyError(f"policy ({self.source}) names unknown op {op!r}; "
                                  f"known ops: {', '.join(sorted(registry.ops))}")
            known = registry.impl_ids(op)
            for item in items:
                if "." in item and item not in known:
                    raise PolicyError(f"policy ({self.source}): op {op!r} has no implementation {item!r}; "
                                      f"it has: {', '.join(sorted(known))}")
        for d in sorted(self.deny):
            if "." in d and d not in all_ids:
                raise PolicyError(f"policy ({self.source}) denies unknown implementation {d!r}; "
                                  f"known: {', '.join(sorted(all_ids))}")
        for op, settings in sorted(self.choices.items()):
            if op not in registry.ops:
                raise PolicyError(f"policy ({self.source}) sets a choice of unknown op {op!r}; "
                                  f"known ops: {', '.join(sorted(registry.ops))}")
            declared = {c.name: (c, i.id) for i in registry.impls[op] for c in i.choices}
            for name, (value, source) in sorted(settings.items()):
                if name not in declared:
                    have = ", ".join(f"{n} ({i})" for n, (_, i) in sorted(declared.items())) or "none"
                    raise PolicyError(f"policy ({source}): op {op!r} has no choice {name!r}; its implementations "
                                      f"declare: {have}")
                for impl in registry.impls[op]:  # every implementation that declares it must accept the value
                    for c in impl.choices:
                        if c.name == name:
                            try:
                                c.parse(value)
                            except ValueError as e:
                                raise PolicyError(f"policy ({source}): {op}.{name} ({impl.id}) {e}") from None

    def choice(self, op: str, name: str) -> tuple[str, str] | None:
        """(value, the layer that set it) of ``<op>.<name>``, or None when the policy leaves it alone."""
        return self.choices.get(op, {}).get(name)

    def is_denied(self, impl_id: str) -> bool:
        return impl_id in self.deny or impl_id.split(".", 1)[0] in self.deny

    def family_order(self, platform) -> tuple[str, ...]:
        rest = [f for f in platform.family_order if f not in self.prefer]
        rest += [f for f in KNOWN_FAMILIES if f not in self.prefer and f not in rest]
        return tuple(self.prefer) + tuple(rest)

    def describe(self) -> str:
        parts = []
        if self.prefer:
            parts.append("prefer=" + "|".join(self.prefer))
        parts += [f"{op}={'|'.join(v)}" for op, v in sorted(self.per_op.items())]
        parts += [f"{op}.{name}={value}" for op, c in sorted(self.choices.items())
                  for name, (value, _) in sorted(c.items())]
        if self.deny:
            parts.append("deny=" + ",".join(sorted(self.deny)))
        if self.strict:
            parts.append("strict=1")
        if self.batch_invariant:
            parts.append("invariant=all")
        elif self.invariant:
            parts.append("invariant=" + ",".join(sorted(self.invariant)))
        if self.kv_cache != "auto":
            parts.append(f"kv_cache={self.kv_cache}")
        return ";".join(parts) or "(platform default)"
