"""`turnout models`: every causal-LM architecture transformers knows and how it runs here (native, through
transformers' modeling code, or refused and why); `turnout models MODEL`: which implementation that model would
use; `--check`: the model-level conformance suite (turnout/entrypoints/models_check.py); `--markdown`: the table of
docs/models.md."""

from __future__ import annotations

import json
import sys

STATUSES = ("native", "transformers", "refused")


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", help="a model directory, .gguf file or Hub id (cached): which implementation "
                   "it would run with")
    p.add_argument("--model-impl", default="auto", choices=("auto", "native", "transformers"),
                   help="the implementation asked for (as the engine's --model-impl)")
    p.add_argument("--json", action="store_true", help="print the table (or --check results) as JSON")
    p.add_argument("--markdown", action="store_true", help="print the table as the Markdown of docs/models.md")
    p.add_argument("--check", action="store_true", help="conformance: each architecture from a tiny random config "
                   "through turnout (native and through transformers) against HF transformers: greedy tokens and logits")
    p.add_argument("--arch", action="append", metavar="NAME", help="with --check or the table: only this model_type "
                   "or class name (repeat, or comma-separate, for several)")
    p.add_argument("--device", default="auto", help="platform the check runs on (default: auto)")


def architecture_table(only: set[str] | None = None) -> list[dict]:
    """One row per (model_type, class) of transformers' causal-LM mapping: status and reason."""
    from transformers import AutoConfig

    from turnout.models.registry import MODELS
    from turnout.models.transformers_backend.support import (
        causal_lm_architectures,
        class_reason,
        config_reason,
        transformers_class,
    )

    rows = []
    for model_type, name in causal_lm_architectures():
        if only and model_type not in only and name not in only:
            continue
        cls = transformers_class(name)
        why = "this transformers cannot import it" if cls is None else class_reason(cls)
        if why is None:
            try:
                why = config_reason(AutoConfig.for_model(model_type))
            except Exception as e:  # noqa: BLE001 - a config class that cannot be made with its defaults
                why = f"its default config cannot be made ({type(e).__name__})"
        status = "native" if name in MODELS else ("refused" if why else "transformers")
        rows.append({"model_type": model_type, "architecture": name, "status": status,
                     "transformers_backend": why is None, "reason": why})
    return rows


def _model_choice(model: str, model_impl: str) -> dict:
    from turnout.loader import config_of
    from turnout.models.registry import native_architecture, resolve_model_class

    config = config_of(model)
    archs = getattr(config, "architectures", None)
    try:
        cls = resolve_model_class(config, model_impl)
    except ValueError as e:
        return {"model": model, "architectures": archs, "model_impl": model_impl, "implementation": "refused",
                "reason": str(e)}
    native = native_architecture(archs) is not None and cls.__name__ != "TransformersForCausalLM"
    return {"model": model, "architectures": archs, "model_impl": model_impl,
            "implementation": "native" if native else "transformers", "class": cls.__name__, "reason": None}


def _markdown(rows: list[dict], checks: dict | None = None) -> str:
    """The table; with ``checks`` ((architecture, impl) -> CheckResult) a column of the conformance results."""
    head = "| model_type | architecture | runs here | why not through transformers |"
    out = [head + (" check (native / transformers) |" if checks is not None else ""),
           "|---|---|---|---|" + ("---|" if checks is not None else "")]
    counts = dict.fromkeys(STATUSES, 0)
    passed = 0
    for r in rows:
        status, why = r["status"], r["reason"] or ""
        res = (checks or {}).get((r["model_type"], "transformers"))
        if res is not None and not res.ok:  # the build or the comparison found what the class alone did not say
            if res.reference_error:
                why = f"not checked: transformers' own tiny model failed ({res.error[:160]})"
            else:
                status = "refused" if status == "transformers" and res.error else status
                why = _check_reason(res)
        why = why.replace("|", "\\|").replace("\n", " ")
        counts[status] += 1
        passed += bool(res is not None and res.ok)
        line = f"| {r['model_type']} | {r['architecture']} | {status} | {why} |"
        if checks is not None:
            cells = []
            for impl in ("native", "transformers"):
                res = checks.get((r["model_type"], impl))
                if res is not None:
                    cells.append(f"{impl}: " + ("passed" if res.ok else "not checked" if res.reference_error else
                                                "failed"))
            line += f" {'; '.join(cells)} |"
        out.append(line)
    checked = f"; {passed} pass the check through transformers" if checks is not None else ""
    title = (f"{len(rows)} causal-LM architectures of transformers: {counts['native']} native, "
             f"{counts['transformers']} through transformers' modeling code, {counts['refused']} refused{checked}.")
    return "\n".join([title, "", *out])


def _check_reason(res) -> str:
    """A failed check in a table cell: the refusal without its preamble, or what differed."""
    if res.error:
        text = res.error.split("cannot run through transformers' modeling code: ", 1)[-1]
        return text.removeprefix("ValueError: ")[:200]
    what = [] if res.greedy_equal else ["greedy tokens differ from transformers'"]
    if res.max_logit_diff is not None and res.max_logit_diff > 1e-4:
        what.append(f"logits differ by {res.max_logit_diff:.1e}")
    return "the check fails: " + ", ".join(what)


def run(args) -> int:
    only = {a for item in args.arch or [] for a in item.split(",") if a} or None
    if args.model:
        choice = _model_choice(args.model, args.model_impl)
        if args.json:
            print(json.dumps(choice, indent=2))
        else:
            what = choice["implementation"]
            print(f"{args.model}: {what}" + (f" ({choice['class']})" if what != "refused" else f": {choice['reason']}"))
        return 0 if choice["implementation"] != "refused" else 1
    rows = architecture_table(only)
    if args.check:
        return _check(rows, args)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.markdown:
        print(_markdown(rows))
    else:
        width = max((len(r["architecture"]) for r in rows), default=10)
        for r in rows:
            print(f"{r['architecture']:<{width}}  {r['status']:<12}  {r['reason'] or ''}")
        counts = ", ".join(f"{sum(r['status'] == s for r in rows)} {s}" for s in STATUSES)
        print(f"{len(rows)} architectures: {counts}")
    return 0


def _check(rows: list[dict], args) -> int:
    from turnout.entrypoints.models_check import check_architecture

    results = []
    for r in rows:
        impls = (["native"] if r["status"] == "native" else []) + (["transformers"] if r["transformers_backend"] else [])
        for impl in impls:
            res = check_architecture(r["model_type"], impl, device=args.device)
            results.append(res)
            detail = res.error or (f"greedy {'equal' if res.greedy_equal else 'DIFFERENT'}, logits max diff "
                                   f"{res.max_logit_diff:.2e}")
            print(f"{'ok  ' if res.ok else 'FAIL'} {r['architecture']:<32} {impl:<12} {res.seconds:5.1f}s  {detail}",
                  file=sys.stderr if args.json or args.markdown else sys.stdout, flush=True)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    elif args.markdown:
        print(_markdown(rows, {(r.model_type, r.model_impl): r for r in results}))
    else:
        print(f"{sum(r.ok for r in results)} of {len(results)} passed", file=sys.stderr)
    return 0 if all(r.ok for r in results) else 1
