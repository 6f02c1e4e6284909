"""`turnout serve`'s command line: vLLM's spellings, a port in use failing at once, and docs/serve.md's flag
tables agreeing with `turnout serve --help`."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO
from turnout.entrypoints.openai import serve_cmd, serve_docs


def _args(*argv):
    from turnout.entrypoints import cli

    return cli.build_parser().parse_args(["serve", *argv])


def _serve(*argv, timeout=30):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "turnout.entrypoints.cli", "serve", *argv], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0


def test_port_in_use_fails_at_once_naming_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r, took = _serve("--port", str(port))
    assert r.returncode == 2, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert took < 1.0, took  # the model never started loading


def test_bad_host_and_port_are_named():
    r, _ = _serve("--port", "70000")
    assert r.returncode == 2 and "--port" in r.stderr
    r, _ = _serve("--host", "no-such-host.invalid", "--port", "0")
    assert r.returncode == 2 and "--host" in r.stderr


def test_model_flag_and_positional():
    assert serve_cmd.build_config(_args("--model", "m.gguf")).model == "m.gguf"
    assert serve_cmd.build_config(_args("m.gguf")).model == "m.gguf"
    assert serve_cmd.build_config(_args("m.gguf", "--model", "m.gguf")).model == "m.gguf"
    assert serve_cmd.build_config(_args()).model is None
    with pytest.raises(ValueError, match="^--model:"):
        serve_cmd.build_config(_args("a.gguf", "--model", "b.gguf"))


@pytest.mark.parametrize("flag,field,default", [("enable-prefix-caching", "enable_prefix_caching", True),
                                                ("enforce-eager", "enforce_eager", False),
                                                ("async-scheduling", "async_scheduling", None)])
def test_boolean_flags_have_both_forms(flag, field, default):
    assert getattr(serve_cmd.build_config(_args()), field) is default
    assert getattr(serve_cmd.build_config(_args(f"--{flag}")), field) is True
    assert getattr(serve_cmd.build_config(_args(f"--no-{flag}")), field) is False


def test_engine_limits_reach_the_config():
    c = serve_cmd.build_config(_args("--max-tokens-per-request", "5000", "--fair-share-seqs", "4"))
    assert c.max_tokens_per_request == 5000 and c.fair_share_seqs == 4
    assert serve_cmd.build_config(_args()).max_num_seqs is None  # what the cache holds (worker/concurrency.py)
    assert serve_cmd.build_config(_args("--max-num-seqs", "12")).max_num_seqs == 12
    c = serve_cmd.build_config(_args("--fair-share-seqs", "0"))
    assert c.max_tokens_per_request is None and c.fair_share_seqs is None
    with pytest.raises(ValueError, match="max_tokens_per_request"):
        serve_cmd.build_config(_args("--max-tokens-per-request", "0"))


def test_bad_limits_are_refused_before_binding():
    r, _ = _serve("--timeout-header", "-1", "--port", "0")
    assert r.returncode == 2 and "--timeout-header" in r.stderr
    r, _ = _serve("--max-connections", "0", "--port", "0")
    assert r.returncode == 2 and "--max-connections" in r.stderr


def test_docs_flag_tables_are_generated_from_the_parser():
    text = serve_docs.DOC.read_text()
    assert serve_docs.render(text) == text, "docs/serve.md is stale: python -m turnout.entrypoints.openai.serve_docs"


def test_docs_and_help_agree():
    r = subprocess.run([sys.executable, "-m", "turnout.entrypoints.cli", "serve", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    in_help = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", r.stdout)) - {"--help"}
    section = serve_docs.DOC.read_text().partition(serve_docs.BEGIN)[2].partition(serve_docs.END)[0]
    in_docs = set(re.findall(r"`(--[a-z][a-z0-9-]+)`", section))
    assert in_help == in_docs, (sorted(in_help - in_docs), sorted(in_docs - in_help))
    assert "--model" in in_help and "--no-enable-prefix-caching" in in_help and "--max-tokens-per-request" in in_help
