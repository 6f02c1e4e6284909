"""`turnout ops`: text and JSON shapes, TURNOUT_OPS honoured, errors as one line with exit code 2,
and `--check` (conformance pass/fail and max error per implementation)."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turnout import envs
from turnout.entrypoints import cli
from turnout.ops import Impl, build_registry, doctor
from turnout.platforms import detect_platform


@pytest.fixture
def registry():
    return build_registry(plugins=False)


def run_main(registry, **kw):
    out = io.StringIO()
    rc = doctor.main(out=out, registry=registry, **kw)
    return rc, out.getvalue()


def _cpu_default(registry, op):
    """On cpu the platform order is vendor, reference, triton: vendor.cpu_native where it exists and built here,
    else vendor.cpu where it exists; None for an optional op that needs what the cpu lacks (device streams:
    swap_layer_async)."""
    if registry.ops[op].requires is not None and not registry.ops[op].requires(detect_platform("cpu"))[0]:
        return None
    if "vendor.cpu_native" in registry.impl_ids(op) and native_builds():
        return "vendor.cpu_native"
    return "vendor.cpu" if "vendor.cpu" in registry.impl_ids(op) else "reference.torch"


def native_builds() -> bool:
    from turnout.ops.spec import ImplUnavailable
    from turnout.ops.vendors.cpu import native

    try:
        native.load()
    except ImplUnavailable:
        return False
    return True


def test_json_shape(registry, monkeypatch):
    monkeypatch.delenv("TURNOUT_OPS", raising=False)
    envs.reload()
    rc, text = run_main(registry, as_json=True, device="cpu")
    assert rc == 0
    rows = json.loads(text)
    assert isinstance(rows, list) and [r["op"] for r in rows] == sorted(registry.ops)
    for r in rows:
        # an op the cpu has no use for (swap_layer_async: no device streams) says so, and is no error
        assert set(r) == {"op", "chosen", "candidates"} | ({"not_needed"} if r["chosen"] is None else set())
        assert r["chosen"] == _cpu_default(registry, r["op"])  # on cpu, by default
        assert {c["impl"] for c in r["candidates"]} == registry.impl_ids(r["op"])
        for c in r["candidates"]:
            assert {"impl", "available", "reason"} <= set(c)
            assert isinstance(c["available"], bool) and isinstance(c["reason"], str) and c["reason"]


def test_text_shape(registry, monkeypatch):
    monkeypatch.delenv("TURNOUT_OPS", raising=False)
    envs.reload()
    rc, text = run_main(registry, device="cpu")
    assert rc == 0
    assert text.startswith("platform: cpu")
    assert "builtin:cuda" in text and "* builtin:cpu" in text  # what each platform probe said
    assert "policy: (platform default)" in text
    for op in registry.ops:
        assert f"{op}  ->  {_cpu_default(registry, op) or 'not needed on this platform'}" in text
    assert "NONE" not in text and "   ! " not in text  # nothing missing on cpu
    assert "   * reference.torch  available" in text


def test_honours_turnout_ops(registry, monkeypatch):
    monkeypatch.setenv("TURNOUT_OPS", "rms_norm=reference.torch;deny=triton")
    envs.reload()
    rc, text = run_main(registry, as_json=True, device="cpu", ops=["rms_norm", "silu_and_mul"])
    rows = {r["op"]: r for r in json.loads(text)}
    assert set(rows) == {"rms_norm", "silu_and_mul"}
    reasons = {c["impl"]: c["reason"] for c in rows["rms_norm"]["candidates"]}
    assert "not in the policy's order for rms_norm" in reasons["triton.default"]
    reasons = {c["impl"]: c["reason"] for c in rows["silu_and_mul"]["candidates"]}
    assert reasons["triton.default"] == "denied by policy (TURNOUT_OPS)"


def test_strict_policy_shows_the_error_instead_of_crashing(registry, monkeypatch):
    monkeypatch.setenv("TURNOUT_OPS", "rms_norm=vendor.cuda|reference.torch;strict=1")
    envs.reload()
    rc, text = run_main(registry, device="cpu", ops=["rms_norm"])
    assert rc == 1
    assert "rms_norm  ->  NONE" in text and "! op 'rms_norm' on platform cpu: strict policy" in text


def test_unknown_op_filter(registry):
    with pytest.raises(ValueError, match="unknown op 'rms_nrom'"):
        run_main(registry, device="cpu", ops=["rms_nrom"])


def _vendor(fn):
    return Impl("silu_and_mul", "vendor.testchip", fn, platforms=("cpu",))


def test_check_reports_pass_and_max_error(registry):
    def good(x):
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]

    registry.add_impl(_vendor(good))
    rc, text = run_main(registry, check=True, device="cpu", ops=["silu_and_mul"])
    line = next(line for line in text.splitlines() if "vendor.testchip" in line)
    assert "PASS" in line and "max error 0" in line
    rc, text = run_main(registry, check=True, as_json=True, device="cpu", ops=["silu_and_mul"])
    rows = {r["impl"]: r for r in json.loads(text)}
    assert rows["vendor.testchip"]["passed"] is True and rows["vendor.testchip"]["max_error"] == 0.0
    assert "reference.torch" not in rows


def test_check_reports_fail(registry):
    def off_by_a_bit(x):
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:] + 0.5

    registry.add_impl(_vendor(off_by_a_bit))
    rc, text = run_main(registry, check=True, device="cpu", ops=["silu_and_mul"])
    assert rc == 1
    line = next(line for line in text.splitlines() if "vendor.testchip" in line)
    assert "FAIL" in line and "max error 0.5" in line


def test_check_runs_what_exists_here(registry):
    # Whatever Triton kernel exists runs under TRITON_INTERPRET=1 (tests/conftest.py); the rest is SKIP.
    rc, text = run_main(registry, check=True, device="cpu", ops=["silu_and_mul"])
    *body, summary = text.splitlines()[1:]
    verdicts = [line for line in body if line.strip()
                and "no non-reference implementation is available here" not in line]  # a GPU without the interpreter
    assert verdicts and all(any(v in line for v in ("PASS", "FAIL", "SKIP")) for line in verdicts)
    assert rc == (1 if any("FAIL" in line for line in verdicts) else 0)
    assert any("vendor.cuda" in line and "SKIP" in line for line in verdicts)
    # the last line counts them: implementations that pass, fail, could not be tested here
    count = {v: sum(f" {v}" in line for line in verdicts) for v in ("PASS", "FAIL", "SKIP")}
    assert summary.endswith(f"pass, {count['FAIL']} fail, {count['SKIP']} skipped"), (summary, count)
    assert summary.startswith(f"{count['PASS']} implementation"), (summary, count)


def test_an_op_the_platform_has_no_use_for_is_not_a_failure(registry):
    """swap_layer_async overlaps copies on device streams; the cpu has none: "not needed", not NONE / SKIP."""
    rc, text = run_main(registry, device="cpu", ops=["swap_layer_async"])
    assert rc == 0 and "swap_layer_async  ->  not needed on this platform" in text and "NONE" not in text
    rc, text = run_main(registry, check=True, device="cpu", ops=["swap_layer_async"])
    assert rc == 0 and "NOT NEEDED" in text and "no device streams" in text, text
    assert text.splitlines()[-1] == "0 implementations pass, 0 fail, 0 skipped"


# --- the command line ---------------------------------------------------------------------------

def _turnout(*args, env_extra=None):
    exe = Path(sys.executable).with_name("turnout")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "turnout.entrypoints.cli"]
    env = {k: v for k, v in os.environ.items() if k != "TURNOUT_OPS"}
    env.update(env_extra or {})
    return subprocess.run(cmd + ["ops", *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_json(monkeypatch, capsys):
    monkeypatch.delenv("TURNOUT_OPS", raising=False)
    envs.reload()
    assert cli.main(["ops", "--json", "--op", "rms_norm", "--op", "sample"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["op"] for r in rows] == ["rms_norm", "sample"]
    assert all({"op", "chosen", "candidates"} <= set(r) for r in rows)


@pytest.mark.parametrize("value,needle", [("prefer=gpu", "unknown family 'gpu'"),
                                          ("rms_nrom=reference.torch", "unknown op 'rms_nrom'"),
                                          ("strict=2", "strict must be 0 or 1")])
def test_cli_bad_turnout_ops_is_one_line_and_exit_2(value, needle, monkeypatch, capsys):
    monkeypatch.setenv("TURNOUT_OPS", value)
    envs.reload()
    assert cli.main(["ops"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("turnout ops: error: ")
    assert "TURNOUT_OPS" in err[0] and needle in err[0]


def test_cli_bad_turnout_ops_in_a_subprocess():
    p = _turnout("--json", env_extra={"TURNOUT_OPS": "rms_norm=triton.nosuch"})
    assert p.returncode == 2 and p.stdout == ""
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("turnout ops: error: policy (TURNOUT_OPS): op 'rms_norm' "
                                                        "has no implementation 'triton.nosuch'")
