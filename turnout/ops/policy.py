"""The op policy: which implementation families to prefer, per-op orders, a deny list, strict mode.

Grammar (clauses separated by ';', whitespace ignored)::

    prefer=<family>|<family>...     families first, in this order; the others follow in platform order
    <op>=<impl id>|<impl id>...     exactly these candidates for this op, in this order
    deny=<impl id or family>,...    never use these ("vendor.cuda", or a whole family "vendor")
    strict=0|1                      1: no fallback; an unavailable or failing choice is an error

Example: ``rms_norm=triton.default|reference.torch;deny=vendor.cuda;strict=1``.
The engine config's policy string is read first; ``TURNOUT_OPS`` is applied on top of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

ENV_VAR = "TURNOUT_OPS"
KNOWN_FAMILIES = ("vendor", "triton", "reference")


class PolicyError(ValueError):
    """A malformed policy string, or one naming an unknown op or implementation."""


@dataclass(frozen=True)
class Policy:
    prefer: tuple[str, ...] = ()
    per_op: dict[str, tuple[str, ...]] = field(default_factory=dict)
    deny: frozenset[str] = frozenset()
    strict: bool = False
    source: str = "default"

    @classmethod
    def parse(cls, text: str | None, source: str = "string", base: "Policy | None" = None) -> "Policy":
        pol = base or cls()
        prefer, per_op, deny, strict = pol.prefer, dict(pol.per_op), set(pol.deny), pol.strict
        for raw in (text or "").split(";"):
            clause = raw.strip()
            if not clause:
                continue
            key, sep, value = clause.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key or not value:
                raise PolicyError(f"{source}: clause {clause!r} is not 'key=value'")
            items = tuple(v.strip() for v in value.replace(",", "|").split("|"))
            if any(not v for v in items):
                raise PolicyError(f"{source}: empty name in {clause!r}")
            if key == "prefer":
                bad = [f for f in items if f not in KNOWN_FAMILIES]
                if bad:
                    raise PolicyError(f"{source}: unknown family {bad[0]!r} in {clause!r} "
                                      f"(families: {', '.join(KNOWN_FAMILIES)})")
                prefer = items
            elif key == "deny":
                deny |= set(items)
            elif key == "strict":
                if value not in ("0", "1", "true", "false"):
                    raise PolicyError(f"{source}: strict must be 0 or 1, got {value!r}")
                strict = value in ("1", "true")
            else:
                for impl in items:
                    if "." not in impl:
                        raise PolicyError(f"{source}: {impl!r} in {clause!r} is not an implementation id "
                                          "'<family>.<name>'")
                per_op[key] = items
        return replace(pol, prefer=prefer, per_op=per_op, deny=frozenset(deny), strict=strict,
                       source=source if pol.source == "default" else f"{pol.source}+{source}")

    @classmethod
    def from_sources(cls, config_text: str | None = None, env: dict | None = None) -> "Policy":
        """The engine config's policy, then ``TURNOUT_OPS`` on top. Read once, at engine start."""
        env = os.environ if env is None else env
        pol = cls.parse(config_text, source="ops_policy") if config_text else cls()
        env_text = env.get(ENV_VAR)
        if env_text:
            pol = cls.parse(env_text, source=ENV_VAR, base=pol)
        return pol

    def validate(self, registry) -> None:
        """Unknown op or implementation names are errors at start-up, not silently ignored."""
        all_ids = registry.impl_ids()
        for op, impls in self.per_op.items():
            if op not in registry.ops:
                raise PolicyError(f"policy ({self.source}) names unknown op {op!r}; "
                                  f"known ops: {', '.join(sorted(registry.ops))}")
            known = registry.impl_ids(op)
            for impl in impls:
                if impl not in known:
                    raise PolicyError(f"policy ({self.source}): op {op!r} has no implementation {impl!r}; "
                                      f"it has: {', '.join(sorted(known))}")
        for d in self.deny:
            if d not in all_ids and d not in KNOWN_FAMILIES:
                raise PolicyError(f"policy ({self.source}) denies unknown implementation {d!r}; "
                                  f"known: {', '.join(sorted(all_ids))}")

    def is_denied(self, impl_id: str) -> bool:
        return impl_id in self.deny or impl_id.split(".", 1)[0] in self.deny

    def family_order(self, platform) -> tuple[str, ...]:
        rest = [f for f in platform.family_order if f not in self.prefer]
        return tuple(self.prefer) + tuple(rest)

    def describe(self) -> str:
        parts = []
        if self.prefer:
            parts.append("prefer=" + "|".join(self.prefer))
        parts += [f"{op}={'|'.join(v)}" for op, v in sorted(self.per_op.items())]
        if self.deny:
            parts.append("deny=" + ",".join(sorted(self.deny)))
        if self.strict:
            parts.append("strict=1")
        return ";".join(parts) or "(platform default)"
