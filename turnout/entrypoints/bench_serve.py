"""`turnout bench serve`: load a RUNNING OpenAI-compatible server and measure it, as `vllm bench serve` does.

Every request streams (with ``stream_options.include_usage``); arrivals are Poisson at ``--request-rate``
(gamma with ``--burstiness`` != 1; ``inf``: all at once), optionally capped at ``--max-concurrency`` in
flight. Prints a table and one ``JSON {...}`` line of the summary; ``--result-json F`` writes the summary
with the per-request arrays, ``--plot F.png`` the latency CDFs and throughput over time. A failed request
is counted (and its reason kept), never fatal; the exit status is 1 only when no request succeeded.

    turnout bench serve --base-url http://127.0.0.1:8000 --dataset random --random-input-len 512 \\
        --random-output-len 128 --num-prompts 200 --request-rate 8 --goodput ttft:500 tpot:50
    turnout bench serve --port 8000 --endpoint chat --dataset jsonl --dataset-path conv.jsonl --max-concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import math
import random
import sys
import time
from pathlib import Path

from turnout.entrypoints import bench_serve_data as data
from turnout.entrypoints import bench_serve_metrics as metrics

logger = logging.getLogger(__name__)
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_ENDPOINT_ALIASES = {"completions": "completions", "/v1/completions": "completions", "chat": "chat",
                     "/v1/chat/completions": "chat", "chat/completions": "chat"}


def add_arguments(p) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="completions", help="completions | chat (or their /v1/... paths)")
    g.add_argument("--model", default=None, help="the served model name (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", choices=("random", "jsonl"), default="random")
    g.add_argument("--dataset-path", default=None, help="--dataset jsonl: one {prompt} / {messages} / "
                   "{conversations} object a line, optional max_tokens")
    g.add_argument("--num-prompts", type=int, default=None, help="default: 1000 (random), every row (jsonl)")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1")
    g.add_argument("--jsonl-output-len", type=int, default=128, help="max_tokens of rows that give none")
    g.add_argument("--shuffle", action="store_true", help="--dataset jsonl: rows in a --seed order")
    g.add_argument("--tokenizer", default=None,
                   help="for token-exact random prompts: a model directory, .gguf file or Hub id; 'none' for "
                        "random words (default: the model's own where it loads locally)")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--num-warmups", type=int, default=1, help="untimed requests first (default 1)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on for --dataset random (exact output lengths), off for jsonl")
    g.add_argument("--extra-body", default=None, metavar="JSON", help="merged into every request body")
    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS (a request is good when it meets every one)")
    g.add_argument("--metric-percentiles", default="50,90,99")
    g.add_argument("--result-json", default=None, metavar="F", help="write the summary and per-request arrays")
    g.add_argument("--plot", default=None, metavar="F.png", help="latency CDFs and throughput over time "
                   "(needs matplotlib: pip install 'turnout[plot]')")


def _validate(args) -> None:
    if importlib.util.find_spec("httpx") is None:
        raise ValueError("turnout bench serve needs httpx, which is not installed: pip install 'httpx>=0.27'")
    ep = _ENDPOINT_ALIASES.get(str(args.endpoint).strip().lower())
    if ep is None:
        raise ValueError(f"--endpoint: expected completions or chat, got {args.endpoint!r}")
    args.endpoint = ep
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts: must be >= 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate: must be > 0 (inf for all at once), got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness: must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency: must be >= 1, got {args.max_concurrency}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio: must be in [0, 1), got {args.random_range_ratio}")
    for name in ("random_input_len", "random_output_len", "jsonl_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups: must be >= 0, got {args.num_warmups}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout: must be > 0 s, got {args.timeout}")
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body: not JSON ({e})") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body: must be a JSON object")
    args.extra = extra
    args.slos = metrics.parse_goodput(args.goodput)
    args.percentiles = metrics.parse_percentiles(args.metric_percentiles)
    if args.plot:
        metrics.require_matplotlib()
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset == "random"
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    for suffix in ("/v1",):  # an OpenAI-style base URL names /v1; the paths here include it
        if args.base_url.endswith(suffix):
            args.base_url = args.base_url[: -len(suffix)]


async def _served_model(client, base_url: str) -> str:
    import httpx

    try:
        r = await client.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise RuntimeError(f"--base-url: cannot list the models of {base_url} ({type(e).__name__}: {e}); "
                           f"is the server up and done loading? (or give --model)") from None


def build_requests(args, tokenizer) -> list[data.BenchRequest]:
    if args.dataset == "jsonl":
        return data.jsonl_requests(args.dataset_path, args.num_prompts, args.jsonl_output_len, args.seed,
                                   args.shuffle, args.endpoint)
    return data.random_requests(args.num_prompts or 1000, args.random_input_len, args.random_output_len,
                                args.random_range_ratio, args.seed, tokenizer, args.endpoint)


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s after the start) of ``n`` requests: gamma gaps with mean 1 / rate (exponential, i.e.
    Poisson arrivals, at burstiness 1); all zero at an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


async def _drive(client, args, reqs, model) -> tuple[list, float, float]:
    from turnout.entrypoints.bench_serve_client import request_body, send

    path = PATHS[args.endpoint]
    bodies = [request_body(args.endpoint, r, model, temperature=args.temperature, ignore_eos=args.ignore_eos,
                           extra=args.extra) for r in reqs]
    for w in range(args.num_warmups):
        res = await send(client, path, args.endpoint, {**bodies[w % len(bodies)], "max_tokens": 4})
        if not res.ok:
            logger.warning("warm-up request %d failed: %s", w, res.error)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    offsets = arrival_offsets(len(bodies), args.request_rate, args.burstiness, args.seed)

    async def one(body):
        if sem is None:
            return await send(client, path, args.endpoint, body)
        async with sem:
            return await send(client, path, args.endpoint, body)

    t0 = time.perf_counter()
    tasks = []
    for off, body in zip(offsets, bodies):
        delay = t0 + off - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(body)))
    results = list(await asyncio.gather(*tasks))
    ends = [r.start + r.e2el for r in results if r.ok]
    end = max(ends) if ends else time.perf_counter()
    return results, t0, end - t0


async def _bench(args) -> tuple[dict, list, float]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    conns = args.max_concurrency or min(args.num_prompts or 1000, 1000)
    limits = httpx.Limits(max_connections=conns + 4, max_keepalive_connections=conns + 4)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))) as client:
        model = args.model or await _served_model(client, args.base_url)
        # a tokenizer (the embedded GGUF's above all) and thousands of prompts take a while: say so
        started = time.perf_counter()
        if args.dataset == "random":
            logger.info("loading the tokenizer for %s ...", args.tokenizer or args.model or model)
        tokenizer = (data.resolve_tokenizer(args.tokenizer, args.model or model)
                     if args.dataset == "random" else None)
        logger.info("building the requests (%s dataset) ...", args.dataset)
        reqs = build_requests(args, tokenizer)
        logger.info("%d requests ready in %.1f s; sending them to %s", len(reqs), time.perf_counter() - started,
                    args.base_url)
        results, t0, duration = await _drive(client, args, reqs, model)
    summary = metrics.summarize(results, duration, args.percentiles, args.slos, t0)
    config = {"bench": "serve", "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
              "dataset": args.dataset, "dataset_path": args.dataset_path, "num_prompts": len(reqs),
              "random_input_len": args.random_input_len if args.dataset == "random" else None,
              "random_output_len": args.random_output_len if args.dataset == "random" else None,
              "random_range_ratio": args.random_range_ratio if args.dataset == "random" else None,
              "token_exact_prompts": tokenizer is not None,
              "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
              "temperature": args.temperature, "ignore_eos": args.ignore_eos, "percentiles": args.percentiles,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return {**config, **summary}, results, t0


def _fmt(v, nd=2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.{nd}f}"
    return str(v)


def format_table(res: dict) -> str:
    rows = [("Successful requests", res["completed"]), ("Failed requests", res["failed"]),
            ("Request rate (req/s)", res["request_rate"]), ("Max concurrency", res["max_concurrency"]),
            ("Benchmark duration (s)", res["duration_s"]), ("Total input tokens", res["total_input_tokens"]),
            ("Total generated tokens", res["total_output_tokens"]),
            ("Request throughput (req/s)", res["request_throughput"])]
    if res["goodput_slos_ms"]:
        rows.append(("Request goodput (req/s)", res["request_goodput"]))
    rows += [("Input token throughput (tok/s)", res["input_throughput"]),
             ("Output token throughput (tok/s)", res["output_throughput"]),
             ("Peak output token throughput (tok/s)", res["max_output_tokens_per_s"]),
             ("Peak concurrent requests", res["max_concurrent_requests"]),
             ("Total token throughput (tok/s)", res["total_token_throughput"])]
    lines = [f"{' Serving Benchmark Result ':=^60}"] + [f"{k + ':':<44}{_fmt(v):>16}" for k, v in rows]
    for m in metrics.METRICS:
        lines.append(f"{' ' + metrics.METRIC_NAMES[m] + ' ':-^60}")
        keys = [("Mean", f"mean_{m}_ms"), ("Std", f"std_{m}_ms")] + [(f"P{q:g}", f"p{q:g}_{m}_ms")
                                                                     for q in res["percentiles"]]
        lines += [f"{f'{label} {m.upper()} (ms):':<44}{_fmt(res.get(key)):>16}" for label, key in keys]
    for why, count in res["errors"].items():
        lines.append(f"failed x{count}: {why}")
    lines.append("=" * 60)
    return "\n".join(lines)


def run(args) -> int:
    _validate(args)
    res, results, t0 = asyncio.run(_bench(args))
    res = metrics.json_safe(res)
    print(format_table(res))
    print("JSON " + json.dumps(res))
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        full = {**res, **metrics.json_safe(metrics.details(results, t0, res["duration_s"]))}
        Path(args.result_json).write_text(json.dumps(full, indent=2) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        title = (f"turnout bench serve: {res['model']} ({res['endpoint']}), {res['num_prompts']} prompts, "
                 f"rate {_fmt(res['request_rate'])}, concurrency {_fmt(res['max_concurrency'])}")
        metrics.plot(results, res, t0, args.plot, title)
    if res["failed"]:
        print(f"turnout bench serve: {res['failed']} of {res['num_prompts']} requests failed", file=sys.stderr)
    return 0 if res["completed"] else 1

