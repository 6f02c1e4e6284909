"""`turnout ops`: the dispatch table of this machine, and the conformance suite on demand."""

from __future__ import annotations

import json
import sys

from turnout.ops.dispatch import resolve_op
from turnout.ops.policy import Policy
from turnout.ops.registry import default_registry


def collect(platform, policy: Policy | None = None) -> list[dict]:
    registry = default_registry()
    policy = policy or Policy.from_sources()
    policy.validate(registry)
    return [resolve_op(op, registry, platform, policy).to_dict() for op in sorted(registry.ops)]


def main(as_json: bool = False, check: bool = False, device: str = "auto", out=sys.stdout) -> int:
    from turnout.platforms import detect_platform

    platform = detect_platform(device)
    policy = Policy.from_sources()
    rows = collect(platform, policy)
    registry = default_registry()
    if check:
        from turnout.ops.conformance import run_conformance

        results = run_conformance(registry, platform)
        summary: dict[tuple, dict] = {}
        for r in results:
            s = summary.setdefault((r.op, r.impl), {"op": r.op, "impl": r.impl, "cases": 0, "failed": 0,
                                                    "max_error": 0.0, "failures": []})
            s["cases"] += 1
            s["max_error"] = max(s["max_error"], r.max_error)
            if not r.ok:
                s["failed"] += 1
                s["failures"].append(f"{r.dtype} {r.case}: {r.message}")
        if as_json:
            json.dump(list(summary.values()), out, indent=2)
            out.write("\n")
        else:
            out.write(f"conformance on {platform.name} ({platform.description}), policy {policy.describe()}\n")
            for s in summary.values():
                verdict = "PASS" if not s["failed"] else f"FAIL ({s['failed']}/{s['cases']})"
                out.write(f"  {s['op']:<20} {s['impl']:<16} {verdict:<14} max error {s['max_error']:.3g}\n")
                for f in s["failures"][:3]:
                    out.write(f"      {f}\n")
            if not summary:
                out.write("  no non-reference implementation is available here\n")
        return 1 if any(s["failed"] for s in summary.values()) else 0
    if as_json:
        json.dump(rows, out, indent=2)
        out.write("\n")
        return 0
    out.write(f"platform: {platform.name} ({platform.description})\npolicy: {policy.describe()}\n\n")
    for row in rows:
        out.write(f"{row['op']}  ->  {row['chosen'] or 'NONE'}\n")
        for c in row["candidates"]:
            mark = "*" if c["impl"] == row["chosen"] else ("+" if c["available"] else "-")
            src = f" [{c['source']}]" if c["source"] != "builtin" else ""
            out.write(f"   {mark} {c['impl']:<18}{src} {c['reason']}\n")
    for p in registry.plugins:
        out.write(f"\nplugin {p.name}: {'loaded' if p.loaded else 'FAILED'}: {p.reason}\n")
    return 0 if all(r["chosen"] for r in rows) else 1
