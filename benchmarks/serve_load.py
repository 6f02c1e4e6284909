"""Load test for `turnout serve`: N concurrent streaming clients, some hanging up at random.

Checks, and fails (exit 1) if any does not hold:
  * every request has exactly one outcome: ok | disconnected | rejected (503) | error;
  * no lost or duplicated tokens: for each finished stream, the tokens streamed (one logprobs entry per
    token) equal usage.completion_tokens, exactly one finish_reason and one [DONE] arrive, and for a sample
    of requests the streamed text equals a non-streamed run with the same seed;
  * afterwards the server is idle again: running = waiting = 0 and KV-cache usage back to its baseline.
Prints requests/s, output tokens/s and TTFT / inter-token latency percentiles as a table and as JSON.

    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000 -n 64 -c 16 --disconnect-frac 0.2

Mixed load (``--mixed``): -n short requests at -c concurrency, first alone, then with one request of
n=--big-n choices running beside them; prints the short ones' TTFT percentiles for both and the p99 ratio
(a fair scheduler keeps it near 1; without one, every step carries all of the big request's sequences):

    python benchmarks/serve_load.py --mixed -n 100 -c 8 --short-max-tokens 4 --big-n 128 --big-max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time

import httpx

from turnout.entrypoints.bench_serve_client import DONE, sse_events
from turnout.entrypoints.bench_serve_metrics import percentile

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def server_gauges(client: httpx.AsyncClient) -> dict:
    text = (await client.get("/metrics")).text
    return {k: _metric(text, f"turnout_{k}") for k in
            ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_requests_in_flight")}


async def wait_idle(client: httpx.AsyncClient, kv_baseline: float, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        g = await server_gauges(client)
        idle = (g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0
                and g["num_requests_in_flight"] == 0 and g["kv_cache_usage_perc"] <= kv_baseline + 1e-9)
        if idle or time.monotonic() > deadline:
            g["idle"] = idle
            return g
        await asyncio.sleep(0.05)


def _pct(xs: list[float], q: float) -> float | None:
    return percentile(xs, q)  # turnout bench serve's definition (linear interpolation), so the two agree


async def _one(client, i, args, rng, outcomes, failures, t_start):
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens, "temperature": 0.8,
            "seed": args.seed + i, "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0,
            "ignore_eos": args.ignore_eos}
    if args.model:
        body["model"] = args.model
    hang_up_after = rng.randint(1, max(1, args.max_tokens - 1)) if rng.random() < args.disconnect_frac else None
    rec = {"i": i, "ttft": None, "itl": [], "tokens": 0, "text": "", "usage": None, "finish": [], "done": 0}

    def settle(outcome, why=None):
        if i in outcomes:
            failures.append(f"request {i}: second outcome {outcome!r} after {outcomes[i]['outcome']!r}")
            return
        rec["outcome"] = outcome
        outcomes[i] = rec
        if why:
            failures.append(f"request {i}: {why}")

    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code == 503:
                await r.aread()
                return settle("rejected")
            if r.status_code != 200:
                await r.aread()
                return settle("error", f"HTTP {r.status_code}: {r.text[:200]}")
            last = None
            async for chunk in sse_events(r):
                if chunk == DONE:
                    rec["done"] += 1
                    continue
                if "error" in chunk:
                    return settle("error", f"error event: {chunk['error']}")
                if chunk.get("usage"):
                    rec["usage"] = chunk["usage"]
                for c in chunk["choices"]:
                    n = len((c.get("logprobs") or {}).get("tokens") or [])
                    rec["text"] += c["text"]
                    if c.get("finish_reason"):
                        rec["finish"].append(c["finish_reason"])
                    if n:
                        now = time.perf_counter()
                        if rec["ttft"] is None:
                            rec["ttft"] = now - t0
                        elif last is not None:
                            rec["itl"].extend([(now - last) / n] * n)
                        last = now
                        rec["tokens"] += n
                if hang_up_after is not None and rec["tokens"] >= hang_up_after:
                    return settle("disconnected")  # leaving the block closes the connection
        if rec["done"] != 1 or len(rec["finish"]) != 1:
            return settle("error", f"{rec['done']} [DONE] and {len(rec['finish'])} finish_reason events")
        if rec["usage"] is None or rec["usage"]["completion_tokens"] != rec["tokens"]:
            return settle("error", f"streamed {rec['tokens']} tokens but usage says {rec['usage']}")
        settle("ok")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        settle("error", f"{type(e).__name__}: {e}")


async def _verify(client, rec, args) -> str | None:
    body = {"prompt": PROMPTS[rec["i"] % len(PROMPTS)], "max_tokens": args.max_tokens, "temperature": 0.8,
            "seed": args.seed + rec["i"], "ignore_eos": args.ignore_eos}
    if args.model:
        body["model"] = args.model
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        return f"verify request {rec['i']}: HTTP {r.status_code}"
    j = r.json()
    if j["choices"][0]["text"] != rec["text"] or j["usage"]["completion_tokens"] != rec["tokens"]:
        return (f"request {rec['i']}: streamed {rec['tokens']} tokens {rec['text']!r}, non-streamed "
                f"{j['usage']['completion_tokens']} tokens {j['choices'][0]['text']!r}")
    return None


async def run_load(base_url: str, *, num_requests: int = 32, concurrency: int = 8, max_tokens: int = 16,
                   disconnect_frac: float = 0.25, seed: int = 0, model: str | None = None,
                   api_key: str | None = None, verify: int = 2, ignore_eos: bool = True) -> dict:
    args = argparse.Namespace(max_tokens=max_tokens, seed=seed, model=model, ignore_eos=ignore_eos,
                              disconnect_frac=disconnect_frac)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(300.0),
                                 limits=limits) as client:
        baseline = await wait_idle(client, float("inf"))
        kv_baseline = baseline["kv_cache_usage_perc"]
        rng = random.Random(seed)
        outcomes: dict[int, dict] = {}
        failures: list[str] = []
        sem = asyncio.Semaphore(concurrency)

        async def worker(i):
            async with sem:
                await _one(client, i, args, rng, outcomes, failures, t_start)

        t_start = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(num_requests)))
        elapsed = time.perf_counter() - t_start
        missing = sorted(set(range(num_requests)) - set(outcomes))
        if missing:
            failures.append(f"requests without an outcome: {missing}")
        after = await wait_idle(client, kv_baseline)
        if not after["idle"]:
            failures.append(f"server not idle after the run: {after} (KV baseline {kv_baseline})")
        ok = [r for r in outcomes.values() if r["outcome"] == "ok"]
        for rec in ok[:verify]:
            if (why := await _verify(client, rec, args)) is not None:
                failures.append(why)
    counts = {k: sum(1 for r in outcomes.values() if r["outcome"] == k)
              for k in ("ok", "disconnected", "rejected", "error")}
    ttft = [r["ttft"] for r in outcomes.values() if r["ttft"] is not None]
    itl = [x for r in outcomes.values() for x in r["itl"]]
    out_tokens = sum(r["tokens"] for r in outcomes.values())
    return {
        "num_requests": num_requests, "concurrency": concurrency, "max_tokens": max_tokens,
        "disconnect_frac": disconnect_frac, "outcomes": counts, "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(num_requests / elapsed, 3), "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "ttft_s": {f"p{q}": _pct(ttft, q) for q in (50, 90, 99)},
        "itl_s": {f"p{q}": _pct(itl, q) for q in (50, 90, 99)},
        "server_after": after, "failures": failures,
    }


# ------------------------------------------------------------------ mixed load: one big request among short ones
async def _short_ttft(client, i, max_tokens, seed, model) -> tuple[float | None, str | None]:
    """One short streaming request: (time to its first token, error)."""
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0.8, "seed": seed + i,
            "stream": True, "logprobs": 0, "ignore_eos": True}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return None, f"short {i}: HTTP {r.status_code}: {r.text[:200]}"
            async for chunk in sse_events(r):
                if chunk == DONE:
                    continue
                if "error" in chunk:
                    return ttft, f"short {i}: error event {chunk['error']}"
                if ttft is None and any((c.get("logprobs") or {}).get("tokens") for c in chunk["choices"]):
                    ttft = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return ttft, f"short {i}: {type(e).__name__}: {e}"
    return ttft, None


async def _big(client, n, max_tokens, seed, model) -> dict:
    body = {"prompt": "Write a long story about a lighthouse keeper.", "n": n, "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed, "ignore_eos": True}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json=body)
    out = {"status": r.status_code, "e2e_s": round(time.perf_counter() - t0, 3)}
    if r.status_code == 200:
        out["completion_tokens"] = r.json()["usage"]["completion_tokens"]
    else:
        out["error"] = r.text[:300]
    return out


async def _phase(client, *, with_big, num_short, concurrency, short_max_tokens, big_n, big_max_tokens, seed,
                 model) -> dict:
    await wait_idle(client, float("inf"), timeout=120)
    big_task = None
    if with_big:
        big_task = asyncio.ensure_future(_big(client, big_n, big_max_tokens, seed, model))
        deadline = time.monotonic() + 30  # let it be admitted and start before the short ones arrive
        while time.monotonic() < deadline and (await server_gauges(client))["num_requests_running"] < 1:
            await asyncio.sleep(0.02)
    sem = asyncio.Semaphore(concurrency)

    async def one(i):
        async with sem:
            return await _short_ttft(client, i, short_max_tokens, seed, model)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(num_short)))
    shorts_s = time.perf_counter() - t0
    big_running_at_end = with_big and not big_task.done()
    big = await big_task if big_task is not None else None
    ttft = [t for t, _ in results if t is not None]
    return {"short_ttft_s": {f"p{q}": _pct(ttft, q) for q in (50, 90, 99)}, "shorts_elapsed_s": round(shorts_s, 3),
            "short_errors": [e for _, e in results if e], "big": big,
            "big_still_running_when_shorts_ended": big_running_at_end, "_ttft": ttft}


def _pool(runs: list[dict]) -> dict:
    """One phase's rounds as one: TTFT percentiles over every short request of every round."""
    if len(runs) == 1:
        return runs[0]
    ttft = [t for r in runs for t in r["_ttft"]]
    return {"short_ttft_s": {f"p{q}": _pct(ttft, q) for q in (50, 90, 99)},
            "shorts_elapsed_s": round(sum(r["shorts_elapsed_s"] for r in runs) / len(runs), 3),
            "short_errors": [e for r in runs for e in r["short_errors"]], "big": runs[-1]["big"],
            "big_still_running_when_shorts_ended": all(r["big_still_running_when_shorts_ended"] for r in runs),
            "rounds": [{k: v for k, v in r.items() if k != "_ttft"} for r in runs], "_ttft": ttft}


async def run_mixed(base_url: str, *, num_short: int = 100, concurrency: int = 8, short_max_tokens: int = 4,
                    big_n: int = 128, big_max_tokens: int = 32, seed: int = 0, model: str | None = None,
                    api_key: str | None = None, rounds: int = 1) -> dict:
    """p99 TTFT of ``num_short`` short requests, alone and with one n=``big_n`` request running beside them.
    With ``rounds`` > 1 the two phases alternate (alone, mixed, alone, ...) so that a machine whose load
    drifts (other processes) weighs on both alike; the TTFTs of all rounds are pooled per phase."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    kw = dict(num_short=num_short, concurrency=concurrency, short_max_tokens=short_max_tokens, big_n=big_n,
              big_max_tokens=big_max_tokens, seed=seed, model=model)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(600.0),
                                 limits=limits) as client:
        await asyncio.gather(*(_short_ttft(client, i, 2, seed, model) for i in range(concurrency)))  # warm up
        phases = {"alone": [], "mixed": []}
        for _ in range(max(1, rounds)):
            phases["alone"].append(await _phase(client, with_big=False, **kw))
            phases["mixed"].append(await _phase(client, with_big=True, **kw))
    alone, mixed = (_pool(phases[k]) for k in ("alone", "mixed"))
    p99a, p99m = alone["short_ttft_s"]["p99"], mixed["short_ttft_s"]["p99"]
    for ph in (alone, mixed):
        ph.pop("_ttft", None)
        for r in ph.get("rounds", []):
            r.pop("_ttft", None)
    failures = alone["short_errors"] + mixed["short_errors"]
    if mixed["big"]["status"] != 200:
        failures.append(f"big request: HTTP {mixed['big']['status']}: {mixed['big'].get('error')}")
    return {"mode": "mixed", **{k: v for k, v in kw.items() if k != "model"}, "rounds": max(1, rounds),
            "alone": alone, "mixed": mixed,
            "p99_ttft_ratio": round(p99m / p99a, 3) if p99a and p99m else None, "failures": failures}


def format_mixed_table(res: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.0f}"

    rows = [("", "short TTFT p50 / p90 / p99 (ms)", "shorts took (s)", "big request")]
    for name in ("alone", "mixed"):
        ph = res[name]
        t = ph["short_ttft_s"]
        big = ph["big"]
        big_s = "-" if big is None else (f"n={res['big_n']}, {big.get('completion_tokens', 0)} tokens, "
                                         f"{big['e2e_s']:.1f} s" + (" (ran past the shorts)"
                                                                   if ph["big_still_running_when_shorts_ended"]
                                                                   else ""))
        rows.append((f"{res['num_short']} short" + (" + 1 big" if name == "mixed" else ""),
                     " / ".join(ms(t[k]) for k in ("p50", "p90", "p99")), f"{ph['shorts_elapsed_s']:.1f}", big_s))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"p99 TTFT with / without the big request: {res['p99_ttft_ratio']}x")
    return "\n".join(lines)


def format_table(res: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.1f}"

    o = res["outcomes"]
    rows = [
        ("requests", f"{res['num_requests']} (ok {o['ok']}, disconnected {o['disconnected']}, "
                     f"rejected {o['rejected']}, error {o['error']})"),
        ("concurrency", str(res["concurrency"])),
        ("elapsed", f"{res['elapsed_s']:.2f} s"),
        ("requests/s", f"{res['requests_per_s']:.2f}"),
        ("output tokens/s", f"{res['output_tokens_per_s']:.1f}"),
        ("TTFT p50/p90/p99", " / ".join(ms(res["ttft_s"][k]) for k in ("p50", "p90", "p99")) + " ms"),
        ("ITL p50/p90/p99", " / ".join(ms(res["itl_s"][k]) for k in ("p50", "p90", "p99")) + " ms"),
        ("idle afterwards", str(res["server_after"]["idle"])),
        ("failures", str(len(res["failures"]))),
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def _report(res: dict, table: str, json_path: str | None) -> int:
    """Print the table and the JSON (and write it to ``json_path``); exit status 1 when anything failed."""
    print(table)
    print(json.dumps(res, indent=2))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
    for f in res["failures"]:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if res["failures"] else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("-n", "--num-requests", type=int, default=64)
    p.add_argument("-c", "--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--disconnect-frac", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--verify", type=int, default=4, help="finished streams re-run non-streamed and compared")
    p.add_argument("--json", default=None, help="also write the JSON result to this file")
    p.add_argument("--mixed", action="store_true",
                   help="mixed load: -n short requests (--short-max-tokens) at -c concurrency, alone and with one "
                        "n=--big-n request beside them; reports both p99 TTFTs of the short ones")
    p.add_argument("--short-max-tokens", type=int, default=4)
    p.add_argument("--big-n", type=int, default=128)
    p.add_argument("--big-max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1, help="--mixed: alternate the two phases this many times")
    a = p.parse_args(argv)
    if a.mixed:
        res = asyncio.run(run_mixed(a.base_url, num_short=a.num_requests, concurrency=a.concurrency,
                                    short_max_tokens=a.short_max_tokens, big_n=a.big_n,
                                    big_max_tokens=a.big_max_tokens, seed=a.seed, model=a.model, api_key=a.api_key,
                                    rounds=a.rounds))
        return _report(res, format_mixed_table(res), a.json)
    res = asyncio.run(run_load(a.base_url, num_requests=a.num_requests, concurrency=a.concurrency,
                               max_tokens=a.max_tokens, disconnect_frac=a.disconnect_frac, seed=a.seed,
                               model=a.model, api_key=a.api_key, verify=a.verify))
    return _report(res, format_table(res), a.json)


if __name__ == "__main__":
    sys.exit(main())
