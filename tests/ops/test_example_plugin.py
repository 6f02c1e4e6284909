"""plugins/turnout-example-vendor, the template for a vendor plugin, installed for real with pip (into a
temporary directory on PYTHONPATH, so the environment is not modified): `turnout ops` shows its platform
and implementations, and `turnout ops --check` passes them against the reference."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "turnout-example-vendor"
OPS = "silu_and_mul,fused_add_rms_norm"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "turnout-example-vendor"
    shutil.copytree(PLUGIN, src)  # build in a copy: nothing is written into the checkout
    target = tmp_path_factory.mktemp("site")
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--quiet", "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (target / "turnout_example_vendor" / "kernels.py").is_file()
    assert list(target.glob("turnout_example_vendor-*.dist-info/entry_points.txt"))
    return target


def _turnout(site, *args, enable=True):
    exe = Path(sys.executable).with_name("turnout")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "turnout.entrypoints.cli"]
    env = {k: v for k, v in os.environ.items() if k not in ("TURNOUT_OPS", "EXAMPLE_VENDOR")}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if enable:
        env["EXAMPLE_VENDOR"] = "1"
    return subprocess.run(cmd + ["ops", *args], capture_output=True, text=True, env=env, timeout=300)


def test_turnout_ops_shows_the_plugin(site):
    p = _turnout(site, "--op", OPS)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.startswith("platform: example (example vendor device")
    assert "* plugin:example" in out and "EXAMPLE_VENDOR=1" in out  # its probe, chosen
    for op in OPS.split(","):
        assert f"{op}  ->  vendor.example\n   * vendor.example [plugin:example]  available" in out
    assert "example: loaded: registered 2 implementation(s)" in out
    rows = {r["op"]: r for r in json.loads(_turnout(site, "--json", "--op", OPS).stdout)}
    assert {r["chosen"] for r in rows.values()} == {"vendor.example"}
    assert all(c["source"] == "plugin:example" for r in rows.values() for c in r["candidates"]
               if c["impl"] == "vendor.example")


def test_the_plugin_passes_conformance(site):
    p = _turnout(site, "--check", "--json", "--op", OPS)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {(r["op"], r["impl"]): r for r in json.loads(p.stdout)}
    for op in OPS.split(","):
        row = rows[(op, "vendor.example")]
        assert row["passed"] and row["failed"] == 0 and row["skipped"] == 0
        assert set(row["max_error_by_dtype"]) == {"float32", "float16", "bfloat16"}


def test_without_its_device_the_plugin_only_says_why(site):
    p = _turnout(site, "--op", "silu_and_mul", enable=False)
    assert p.returncode == 0, p.stderr
    here = p.stdout.split()[1]  # cpu, or the GPU's platform
    assert here != "example"
    assert "- plugin:example" in p.stdout and "no example device" in p.stdout
    assert f"vendor.example [plugin:example]  does not serve platform {here} (serves example)" in p.stdout
