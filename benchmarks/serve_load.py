"""Load test for `turnout serve`: N concurrent streaming clients, some hanging up at random.

Checks, and fails (exit 1) if any does not hold:
  * every request has exactly one outcome: ok | disconnected | rejected (503) | error;
  * no lost or duplicated tokens: for each finished stream, the tokens streamed (one logprobs entry per
    token) equal usage.completion_tokens, exactly one finish_reason and one [DONE] arrive, and for a sample
    of requests the streamed text equals a non-streamed run with the same seed;
  * afterwards the server is idle again: running = waiting = 0 and KV-cache usage back to its baseline.
Prints requests/s, output tokens/s and TTFT / inter-token latency percentiles as a table and as JSON.

    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000 -n 64 -c 16 --disconnect-frac 0.2
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
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


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
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    rec["done"] += 1
                    continue
                chunk = json.loads(data)
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
    a = p.parse_args(argv)
    res = asyncio.run(run_load(a.base_url, num_requests=a.num_requests, concurrency=a.concurrency,
                               max_tokens=a.max_tokens, disconnect_frac=a.disconnect_frac, seed=a.seed,
                               model=a.model, api_key=a.api_key, verify=a.verify))
    print(format_table(res))
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    for f in res["failures"]:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
