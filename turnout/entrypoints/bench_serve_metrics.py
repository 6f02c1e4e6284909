"""The numbers of `turnout bench serve`: latency statistics, throughput, goodput under SLOs, the
throughput timeline, and the plot (matplotlib, optional: ``pip install 'turnout[plot]'``).

Definitions (vLLM's, so the numbers compare): TTFT is the time to the first chunk with content; TPOT is
(e2el - TTFT) / (output tokens - 1) per request; ITL is every gap between two content chunks (a chunk can
carry more than one token); E2EL is send to [DONE]. Throughputs divide the totals by the wall time from the
first send to the last answer. Percentiles interpolate linearly between the sorted samples (numpy's default).
"""

from __future__ import annotations

import math
import statistics

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to first token", "tpot": "Time per output token (excl. 1st)",
                "itl": "Inter-token latency", "e2el": "End-to-end latency"}


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``xs``, linearly interpolated; None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def parse_percentiles(text: str) -> list[float]:
    try:
        qs = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles: expected comma-separated numbers, got {text!r}") from None
    if not qs or any(not 0 < q <= 100 for q in qs):
        raise ValueError(f"--metric-percentiles: each must be in (0, 100], got {text!r}")
    return qs


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        key, sep, val = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"--goodput: {key} needs a number of milliseconds, got {val!r}") from None
        if not ms > 0:
            raise ValueError(f"--goodput: {key} must be > 0 ms, got {val!r}")
        slos[key] = ms
    return slos


def _meets(r, slos: dict[str, float]) -> bool:
    if not r.ok:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    for k, ms in slos.items():
        if values[k] is None:
            if k == "tpot":
                continue  # a one-token answer has no TPOT: nothing to miss
            return False
        if values[k] * 1e3 > ms:
            return False
    return True


def _stats(xs_s: list[float], qs: list[float], name: str) -> dict:
    ms = [x * 1e3 for x in xs_s]
    d = {f"mean_{name}_ms": statistics.fmean(ms) if ms else None,
         f"std_{name}_ms": statistics.pstdev(ms) if ms else None,
         f"median_{name}_ms": percentile(ms, 50)}
    for q in qs:
        d[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return d


def samples(results) -> dict[str, list[float]]:
    ok = [r for r in results if r.ok]
    return {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
            "itl": [x for r in ok for x in r.itl], "e2el": [r.e2el for r in ok]}


def timeline(results, t0: float, duration: float) -> dict:
    """Output tokens/s and requests in flight over the run, in about 50 bins (0.1 s at least). A chunk's
    tokens are its request's usage tokens spread evenly over its chunks."""
    width = max(duration / 50.0, 0.1) if duration > 0 else 0.1
    n = max(1, math.ceil(duration / width))
    tokens = [0.0] * n
    for r in results:
        if r.ok and r.chunk_times:
            per = r.output_tokens / len(r.chunk_times)
            for t in r.chunk_times:
                tokens[min(n - 1, max(0, int((t - t0) / width)))] += per
    mids = [(i + 0.5) * width for i in range(n)]
    spans = [(r.start - t0, r.start - t0 + r.e2el) for r in results if r.ok]
    running = [sum(1 for a, b in spans if a <= m < b) for m in mids]
    return {"bin_s": width, "t_s": mids, "output_tok_s": [x / width for x in tokens], "running": running}


def summarize(results, duration: float, qs: list[float], slos: dict[str, float], t0: float) -> dict:
    ok = [r for r in results if r.ok]
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    d = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "total_input_tokens": in_tok, "total_output_tokens": out_tok,
         "request_throughput": len(ok) / duration if duration > 0 else None,
         "request_goodput": None, "goodput_slos_ms": slos or None,
         "input_throughput": in_tok / duration if duration > 0 else None,
         "output_throughput": out_tok / duration if duration > 0 else None,
         "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else None,
         "usage_missing": sum(1 for r in ok if not r.usage_reported)}
    if slos:
        good = sum(1 for r in ok if _meets(r, slos))
        d["good_requests"] = good
        d["request_goodput"] = good / duration if duration > 0 else None
    tl = timeline(results, t0, duration)
    d["max_output_tokens_per_s"] = max(tl["output_tok_s"], default=None)
    d["max_concurrent_requests"] = max(tl["running"], default=None)
    s = samples(results)
    for m in METRICS:
        d.update(_stats(s[m], qs, m))
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    d["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])  # the ten commonest reasons
    return d


def details(results, t0: float, duration: float) -> dict:
    """Per-request arrays for the JSON file (not the printed line)."""
    return {"input_lens": [r.prompt_tokens for r in results], "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results], "e2els": [r.e2el for r in results],
            "itls": [r.itl for r in results], "start_times": [r.start - t0 for r in results],
            "request_errors": [r.error for r in results], "timeline": timeline(results, t0, duration)}


def json_safe(x):
    """JSON has no inf / nan: None in their place, recursively (shared with `turnout bench latency`)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot: needs matplotlib, which is not installed: pip install 'turnout[plot]' "
                         "(or pip install 'matplotlib>=3.7')") from None


def plot(results, summary: dict, t0: float, path: str, title: str) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2EL) and output throughput / requests in flight over time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    s = samples(results)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, m in zip(axes.flat, METRICS):
        xs = sorted(x * 1e3 for x in s[m])
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post")
            ax.axvline(summary.get(f"median_{m}_ms"), color="grey", ls=":", lw=1)
        ax.set_title(f"{METRIC_NAMES[m]} CDF ({len(xs)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    tl = timeline(results, t0, summary["duration_s"])
    ax = axes.flat[4]
    ax.plot(tl["t_s"], tl["output_tok_s"])
    ax.set_title(f"Output throughput ({tl['bin_s']:.2g} s bins)")
    ax.set_xlabel("s since the first request")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax = axes.flat[5]
    ax.step(tl["t_s"], tl["running"], where="mid")
    ax.set_title("Requests in flight")
    ax.set_ylim(0, max(tl["running"], default=0) + 1)
    ax.set_xlabel("s since the first request")
    ax.set_ylabel("requests")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
