"""`turnout ops`: the dispatch table of this machine, and the conformance suite on demand.

Exit codes: 0 fine; 1 an op has no usable implementation, or a conformance case failed; 2 (from
cli.py) a malformed or unknown ``TURNOUT_OPS`` / ``--op`` / ``--device``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import sys
from pathlib import Path

from turnout.ops.policy import Policy
from turnout.ops.registry import Registry, default_registry
from turnout.ops.resolution import resolve_op


def _select_ops(registry: Registry, ops: list[str] | None) -> list[str]:
    names = [n.strip() for item in ops or () for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in registry.ops]
    if unknown:
        raise ValueError(f"unknown op {unknown[0]!r}; known ops: {', '.join(sorted(registry.ops))}")
    return names or sorted(registry.ops)


def collect(platform, policy: Policy | None = None, registry: Registry | None = None,
            ops: list[str] | None = None) -> list[dict]:
    """One row per op: ``{"op", "chosen", "candidates": [{"impl", "available", "reason", "source"}]}``
    (plus ``"error"`` when nothing can be chosen). Raises PolicyError for a bad policy."""
    registry = registry or default_registry()
    policy = policy or Policy.from_sources(platform=platform)
    policy.validate(registry)
    return [resolve_op(op, registry, platform, policy).to_dict() for op in _select_ops(registry, ops)]


def summarize(results) -> list[dict]:
    """Conformance results folded per (op, implementation)."""
    summary: dict[tuple, dict] = {}
    for r in results:
        s = summary.setdefault((r.op, r.impl), {"op": r.op, "impl": r.impl, "passed": True, "cases": 0,
                                                "failed": 0, "skipped": 0, "max_error": 0.0,
                                                "max_error_by_dtype": {}, "failures": [], "skips": []})
        if r.skipped:  # a case this machine cannot judge (the interpreter's own error): neither pass nor fail
            s["skipped"] += 1
            s["skips"].append(f"{r.dtype} {r.case}: {r.skipped}")
            continue
        s["cases"] += 1
        s["max_error"] = max(s["max_error"], r.max_error)
        s["max_error_by_dtype"][r.dtype] = max(s["max_error_by_dtype"].get(r.dtype, 0.0), r.max_error)
        if not r.ok:
            s["failed"] += 1
            s["passed"] = False
            s["failures"].append(f"{r.dtype} {r.case}: {r.message}")
    return list(summary.values())


def _write_check(out, platform, policy, rows, summary, as_json) -> None:
    if as_json:
        json.dump(summary, out, indent=2)
        out.write("\n")
        return
    out.write(f"conformance on {platform.name} ({platform.description}), policy {policy.describe()}\n")
    tested = {(s["op"], s["impl"]) for s in summary}
    w = max([len(r["op"]) for r in rows] + [20])
    for s in summary:
        if s["cases"]:
            verdict = "PASS" if s["passed"] else f"FAIL ({s['failed']}/{s['cases']})"
            by_dtype = ", ".join(f"{d} {e:.3g}" for d, e in s["max_error_by_dtype"].items())
            out.write(f"  {s['op']:<{w}} {s['impl']:<18} {verdict:<14} max error {s['max_error']:.3g}"
                      f"  ({by_dtype}; {s['cases']} cases)\n")
        for f in s["failures"][:3]:
            out.write(f"      {f}\n")
        if s["skipped"]:  # one line per reason: the cases and why they say nothing here
            by_reason: dict[str, list[str]] = {}
            for item in s["skips"]:
                case, _, why = item.partition(": ")
                by_reason.setdefault(why, []).append(case.split(" ", 1)[0])
            for why, dtypes in by_reason.items():
                out.write(f"  {s['op']:<{w}} {s['impl']:<18} {'SKIP (' + str(len(dtypes)) + ')':<14} "
                          f"{len(dtypes)} {'/'.join(sorted(set(dtypes)))} case(s): {why}\n")
    for row in rows:  # say what could not be tested here, and why
        if row.get("not_needed"):
            out.write(f"  {row['op']:<{w}} {'-':<18} {'NOT NEEDED':<14} not needed on this platform "
                      f"({row['not_needed']})\n")
            continue
        for c in row["candidates"]:
            if c["impl"] != "reference.torch" and (row["op"], c["impl"]) not in tested:
                out.write(f"  {row['op']:<{w}} {c['impl']:<18} {'SKIP':<14} {c['reason']}\n")
    if not summary:
        out.write("  no non-reference implementation is available here\n")
    passed = sum(1 for s in summary if s["cases"] and s["passed"])
    failed = sum(1 for s in summary if not s["passed"])
    skipped = sum(1 for s in summary if not s["cases"] and s["passed"]) + sum(
        1 for row in rows if not row.get("not_needed") for c in row["candidates"]
        if c["impl"] != "reference.torch" and (row["op"], c["impl"]) not in tested)
    out.write(f"{passed} implementation{'s' * (passed != 1)} pass, {failed} fail, {skipped} skipped\n")


_ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) that holds turnout/


def _place(obj) -> tuple[str | None, int | None]:
    """(file, first line) of a function or module, the file relative to the checkout when inside it."""
    try:
        file = inspect.getsourcefile(obj) or inspect.getfile(obj)
    except TypeError:
        return None, None
    try:
        line = inspect.getsourcelines(obj)[1] if not inspect.ismodule(obj) else None
    except (OSError, TypeError):
        line = None
    return _rel(file), line


def _rel(file: str | None) -> str | None:
    if file is None:
        return None
    path = Path(file).resolve()
    return str(path.relative_to(_ROOT)) if path.is_relative_to(_ROOT) else str(path)


def _impl_place(impl) -> dict:
    """Where an implementation's code is: its target (or, for a factory, the loader), found without
    running it. A module that does not import here still has a file (find_spec), just no line."""
    entry = {"impl": impl.id, "source": impl.source, "target": impl.target if isinstance(impl.target, str)
             else f"{getattr(impl.target, '__module__', '?')}:{getattr(impl.target, '__qualname__', '?')}"}
    if callable(impl.target):
        entry["file"], entry["line"] = _place(impl.target)
        return entry
    module, _, attr = impl.target.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        entry["file"], entry["line"] = _place(obj)
        if entry["file"] is None or not str(entry["file"]).endswith(".py"):
            raise TypeError
    except Exception:
        try:
            spec = importlib.util.find_spec(module)
        except Exception:
            spec = None
        entry["file"], entry["line"] = _rel(spec.origin if spec else None), None
    return entry


def where(op: str, registry: Registry | None = None) -> dict:
    """The files of an op: its declaration (reference and sample generator), every implementation, and
    the tests that name it (a source checkout's tests/; the conformance test covers every op)."""
    registry = registry or default_registry()
    if op not in registry.ops:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(sorted(registry.ops))}")
    spec = registry.ops[op]
    ref_file, ref_line = _place(spec.reference)
    gen_file, gen_line = _place(spec.sample_inputs)
    impls = [_impl_place(i) for i in registry.impls[op]]
    tests_dir = _ROOT / "tests"
    tests: list[str] = []
    if tests_dir.is_dir():
        word = re.compile(rf"\b{re.escape(op)}\b")
        for path in sorted(tests_dir.rglob("*.py")):
            try:
                if word.search(path.read_text(errors="replace")):
                    tests.append(str(path.relative_to(_ROOT)))
            except OSError:
                continue
        every = tests_dir / "ops" / "test_conformance.py"
        if every.exists() and str(every.relative_to(_ROOT)) not in tests:
            tests.append(str(every.relative_to(_ROOT)))
    return {"op": op, "spec": {"reference": f"{spec.reference.__module__}:{spec.reference.__qualname__}",
                               "file": ref_file, "line": ref_line, "samples_file": gen_file, "samples_line": gen_line},
            "implementations": impls, "tests": tests}


def _write_where(out, info: dict) -> None:
    def at(file, line):
        return f"{file}:{line}" if line else f"{file}"

    s = info["spec"]
    out.write(f"{info['op']}\n  {'spec':<16} {at(s['file'], s['line'])}  (reference {s['reference']}; "
              f"samples {at(s['samples_file'], s['samples_line'])})\n")
    for i in info["implementations"]:
        src = f" [{i['source']}]" if i["source"] != "builtin" else ""
        out.write(f"  {i['impl']:<16} {at(i['file'], i['line'])}{src}  ({i['target']})\n")
    if info["tests"]:
        for n, t in enumerate(info["tests"]):
            out.write(f"  {'tests' if n == 0 else '':<16} {t}\n")
    else:
        out.write(f"  {'tests':<16} (no tests/ here: a source checkout has them)\n")


def main(as_json: bool = False, check: bool = False, device: str = "auto", ops: list[str] | None = None,
         out=None, registry: Registry | None = None, where_op: str | None = None) -> int:
    from turnout.platforms import detect_platform, probe_all

    out = out or sys.stdout
    if where_op is not None:
        info = where(where_op, registry)
        if as_json:
            json.dump(info, out, indent=2)
            out.write("\n")
        else:
            _write_where(out, info)
        return 0
    probes = probe_all()
    platform = detect_platform(device, results=probes)
    registry = registry or default_registry()
    policy = Policy.from_sources(platform=platform)
    rows = collect(platform, policy, registry, ops)
    if check:
        from turnout.ops.conformance import run_conformance

        results = run_conformance(registry, platform, ops=[r["op"] for r in rows], policy=policy)
        summary = summarize(results)
        _write_check(out, platform, policy, rows, summary, as_json)
        return 0 if all(s["passed"] for s in summary) else 1
    reg = registry or default_registry()
    ok = all(r["chosen"] or reg.ops[r["op"]].optional for r in rows)  # an optional op may be absent here
    if as_json:
        json.dump(rows, out, indent=2)
        out.write("\n")
        return 0 if ok else 1
    out.write(f"platform: {platform.name} ({platform.description}); device {platform.device_type}, "
              f"distributed backend {platform.dist_backend}\n")
    for p in probes:
        mark = "*" if p.platform is platform else ("+" if p.platform is not None else "-")
        out.write(f"   {mark} {p.source:<22} {p.reason}\n")
    out.write(f"policy: {policy.describe()}  [{policy.source}]\n\n")
    out.write("ops (* chosen, + available, - unavailable):\n")
    for row in rows:
        chosen = row["chosen"] or ("not needed on this platform" if row.get("not_needed") else "NONE")
        out.write(f"{row['op']}  ->  {chosen}\n")
        for c in row["candidates"]:
            mark = "*" if c["impl"] == row["chosen"] else ("+" if c["available"] else "-")
            src = f" [{c['source']}]" if c["source"] != "builtin" else ""
            out.write(f"   {mark} {c['impl']}{src}  {c['reason']}\n")
            for ch in c.get("choices", ()):  # decisions made inside the implementation (Impl.choices)
                note = f"; {ch['note']}" if ch.get("note") else ""
                out.write(f"       choice {row['op']}.{ch['name']}={ch['value']} (set by {ch['set_by']}; "
                          f"{ch['allowed']}{note}): {ch['doc']}\n")
        if row.get("error"):
            out.write(f"   ! {row['error']}\n")
    if registry.plugins:
        out.write("\nplugins and vendor modules:\n")
        for p in registry.plugins:
            out.write(f"   {p.name}: {'loaded' if p.loaded else 'FAILED'}: {p.reason}\n")
    return 0 if ok else 1
