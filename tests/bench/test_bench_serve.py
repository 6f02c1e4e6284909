"""`turnout bench serve` against a real `turnout serve` (embedded SmolLM2, small limits, one server for the
module): every metric in the JSON, counts that match --num-prompts and the server's own token counters,
token-exact random prompts, a valid PNG, Poisson-rate and max-concurrency modes, failures counted (a real
400 from the server, an unreachable port), bad flags named. The percentile is checked against numpy's."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from turnout.entrypoints import bench_serve
from turnout.entrypoints import bench_serve_data as data
from turnout.entrypoints.bench_serve_client import RequestResult
from turnout.entrypoints.bench_serve_metrics import METRICS, percentile, summarize
from turnout.entrypoints.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256


def _server_conftest():
    """tests/server/conftest.py under its own name (a bare `import conftest` would find another one)."""
    spec = importlib.util.spec_from_file_location("server_conftest", REPO / "tests" / "server" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def server():
    srv = _server_conftest().ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4",
                                           "--seed", "0")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def _bench(argv, capsys) -> tuple[int, str, str]:
    rc = cli_main(["--log-level", "WARNING", "bench", "serve", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _counter(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M))


def _metric_keys(percentiles=(50, 90, 99)):
    keys = ["completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
            "request_throughput", "request_goodput", "input_throughput", "output_throughput",
            "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests", "errors"]
    for m in METRICS:
        keys += [f"mean_{m}_ms", f"std_{m}_ms", f"median_{m}_ms"] + [f"p{q}_{m}_ms" for q in percentiles]
    return keys


def test_random_token_exact_concurrency_json_plot(server, tmp_path, capsys):
    out_json, png = tmp_path / "r.json", tmp_path / "r.png"
    gen0 = _counter(server.base_url, "turnout_generation_tokens_total")
    fin0 = _counter(server.base_url, "turnout_request_finished_total")
    rc, out, err = _bench(["--base-url", server.base_url + "/v1", "--num-prompts", "4", "--random-input-len", "16",
                           "--random-output-len", "4", "--max-concurrency", "2", "--goodput", "ttft:600000",
                           "e2el:600000", "--result-json", str(out_json), "--plot", str(png)], capsys)
    assert rc == 0, err
    r = json.loads(out_json.read_text())
    missing = [k for k in _metric_keys() if k not in r]
    assert not missing, missing
    assert r["completed"] == 4 and r["failed"] == 0 and r["num_prompts"] == 4 and r["errors"] == {}
    assert r["token_exact_prompts"] is True
    assert r["input_lens"] == [16] * 4 and r["total_input_tokens"] == 64  # the server's usage says so
    assert r["output_lens"] == [4] * 4 and r["total_output_tokens"] == 16  # ignore_eos: exact
    # the server's own counters saw the same: 16 tokens and 4 requests, plus the 4-token warm-up request
    assert _counter(server.base_url, "turnout_generation_tokens_total") - gen0 == 16 + 4
    assert _counter(server.base_url, "turnout_request_finished_total") - fin0 == 4 + 1
    assert r["good_requests"] == 4 and r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert 1 <= r["max_concurrent_requests"] <= 2 and r["max_concurrency"] == 2
    assert r["request_throughput"] == pytest.approx(4 / r["duration_s"])
    for ttft, e2el, itl in zip(r["ttfts"], r["e2els"], r["itls"]):
        assert 0 < ttft <= e2el and len(itl) <= 3 and sum(itl) <= e2el - ttft + 1e-6
    assert r["p99_ttft_ms"] >= r["p50_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0
    summary = json.loads(out.split("JSON ", 1)[1])
    assert summary["completed"] == 4 and "ttfts" not in summary  # the printed line is the summary only
    assert "Successful requests" in out and "P99 TTFT (ms)" in out
    blob = png.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000
    from PIL import Image  # matplotlib's own dependency

    with Image.open(png) as im:
        im.verify()
        assert im.size[0] > 800 and im.size[1] > 500


def test_request_rate_mode_chat(server, tmp_path, capsys):
    out_json = tmp_path / "c.json"
    rc, _, err = _bench(["--port", str(server.port), "--endpoint", "chat", "--tokenizer", "none",
                         "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "3",
                         "--random-range-ratio", "0.5", "--request-rate", "8", "--seed", "3", "--num-warmups", "0",
                         "--result-json", str(out_json)], capsys)
    assert rc == 0, err
    r = json.loads(out_json.read_text())
    assert r["completed"] == 4 and r["failed"] == 0 and r["request_rate"] == 8 and r["endpoint"] == "chat"
    assert r["token_exact_prompts"] is False and all(n > 0 for n in r["input_lens"])
    rng = random.Random(3)
    data.sample_lens(rng, 8, 0.5, 4)
    assert r["output_lens"] == data.sample_lens(rng, 3, 0.5, 4)  # the drawn lengths, exact (ignore_eos)
    offsets = bench_serve.arrival_offsets(4, 8.0, 1.0, 3)
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] > 0
    for sent, planned in zip(r["start_times"], offsets):
        assert sent >= planned - 1e-3  # never before its Poisson arrival time


def test_jsonl_with_a_failing_row_counts_the_failure(server, tmp_path, capsys):
    rows = [{"prompt": "The capital of France is", "max_tokens": 3},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A colour?"},
                          {"role": "assistant", "content": "Blue"}], "max_tokens": 2},
            {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi!"}]},
            {"prompt": "x", "max_tokens": MAX_MODEL_LEN * 4}]  # over the context: the server answers 400
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    out_json = tmp_path / "j.json"
    rc, out, err = _bench(["--port", str(server.port), "--dataset", "jsonl", "--dataset-path", str(path),
                           "--jsonl-output-len", "2", "--max-concurrency", "4", "--num-warmups", "0",
                           "--result-json", str(out_json)], capsys)
    assert rc == 0, err
    r = json.loads(out_json.read_text())
    assert r["num_prompts"] == 4 and r["completed"] == 3 and r["failed"] == 1
    [(why, count)] = r["errors"].items()
    assert count == 1 and why.startswith("HTTP 400") and r["request_errors"][3] == why
    assert all(n >= 1 for n in r["output_lens"][:3]) and "failed x1: HTTP 400" in out
    assert "1 of 4 requests failed" in err


def test_unreachable_server_fails_every_request_without_crashing(tmp_path, capsys):
    port = _server_conftest().free_port()
    out_json = tmp_path / "u.json"
    rc, _, err = _bench(["--port", str(port), "--model", "m", "--tokenizer", "none", "--num-prompts", "3",
                         "--random-input-len", "4", "--num-warmups", "0", "--result-json", str(out_json)], capsys)
    assert rc == 1  # nothing succeeded
    r = json.loads(out_json.read_text())
    assert r["completed"] == 0 and r["failed"] == 3 and r["mean_ttft_ms"] is None
    assert "ConnectError" in next(iter(r["errors"]))


@pytest.mark.parametrize("argv,field", [
    (["--goodput", "ttft"], "--goodput"), (["--goodput", "latency:5"], "--goodput"),
    (["--endpoint", "embeddings"], "--endpoint"), (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--request-rate", "0"], "--request-rate"), (["--max-concurrency", "0"], "--max-concurrency"),
    (["--extra-body", "[1]"], "--extra-body"), (["--dataset", "jsonl"], "--dataset-path"),
    (["--tokenizer", "/nonexistent/tok"], "--tokenizer")])
def test_bad_flags_are_named(argv, field, capsys):
    port = _server_conftest().free_port()  # nothing listens: a flag error must come before any request
    rc, _, err = _bench(["--port", str(port), "--model", "m", "--num-prompts", "2", *argv], capsys)
    assert rc == 2 and field in err, err


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, _, err = _bench(["--model", "m", "--plot", "x.png"], capsys)
    assert rc == 2 and "--plot" in err and "pip install" in err


def test_percentile_matches_numpy_and_goodput_counts_slos():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (1, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))

    def res(ttft, e2el, tokens):
        return RequestResult(ok=True, start=0.0, ttft=ttft, e2el=e2el, chunk_times=[ttft], prompt_tokens=1,
                             output_tokens=tokens, usage_reported=True)

    results = [res(0.1, 0.5, 5), res(0.3, 0.4, 2), res(0.05, 0.05, 1), RequestResult(error="HTTP 400: x")]
    s = summarize(results, 1.0, [50], {"ttft": 200.0, "tpot": 100.0}, 0.0)
    # 1st: ttft 100 ms, tpot 100 ms: good; 2nd: ttft 300 ms: not; 3rd: one token, no tpot: good; 4th failed
    assert s["good_requests"] == 2 and s["request_goodput"] == 2.0 and s["failed"] == 1
    assert s["errors"] == {"HTTP 400: x": 1} and s["total_output_tokens"] == 8
