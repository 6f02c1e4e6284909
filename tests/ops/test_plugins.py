"""Vendor plugins through entry points, with a real (dist-info) package put on sys.path: a working
implementation, one whose kernel module fails to import, a plugin that fails to load, and a platform
plugin. Nothing crashes; everything broken is reported with its reason."""

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from turnout import envs
from turnout.ops import Policy, build_registry, resolve
from turnout.platforms import Platform, detect_platform, probe_all

PLUGIN_MODULES = ("fakechip_turnout", "broken_turnout_plugin")

FILES = {
    "fakechip_turnout/__init__.py": """
        from turnout.ops import Impl

        def register(registry):
            # Declarations only: the kernel modules are imported when probed.
            registry.add_impl(Impl(op="silu_and_mul", id="vendor.fakechip",
                                   target="fakechip_turnout.kernels:silu_and_mul", platforms=("fakechip",)))
            registry.add_impl(Impl(op="rms_norm", id="vendor.fakechip",
                                   target="fakechip_turnout.broken_kernels:rms_norm", platforms=("fakechip",)))
        """,
    "fakechip_turnout/kernels.py": """
        import torch.nn.functional as F

        CALLS = []

        def silu_and_mul(x):
            CALLS.append(x.shape)
            d = x.shape[-1] // 2
            return F.silu(x[..., :d]) * x[..., d:]
        """,
    "fakechip_turnout/broken_kernels.py": """
        raise ImportError("libfakechip_rt.so: cannot open shared object file")
        """,
    "fakechip_turnout/platform.py": """
        from turnout.platforms import Platform

        def probe():
            return Platform(name="fakechip", device_type="cpu", dist_backend="gloo", vendor="fakechip",
                            description="FakeChip accelerator (test double)"), "fakechip driver 1.0 found"
        """,
    "fakechip_turnout-0.1.0.dist-info/METADATA": """
        Metadata-Version: 2.1
        Name: fakechip-turnout
        Version: 0.1.0
        """,
    "fakechip_turnout-0.1.0.dist-info/entry_points.txt": """
        [turnout.ops]
        fakechip = fakechip_turnout:register

        [turnout.platforms]
        fakechip = fakechip_turnout.platform:probe
        """,
    "broken_turnout_plugin/__init__.py": """
        from libbroken_vendor_sdk import kernels  # not installed
        """,
    "broken_turnout_plugin-0.1.0.dist-info/METADATA": """
        Metadata-Version: 2.1
        Name: broken-turnout-plugin
        Version: 0.1.0
        """,
    "broken_turnout_plugin-0.1.0.dist-info/entry_points.txt": """
        [turnout.ops]
        brokenchip = broken_turnout_plugin:register

        [turnout.platforms]
        brokenchip = broken_turnout_plugin:platform
        """,
}


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    for rel, text in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


@pytest.fixture
def installed(plugin_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_dir))
    importlib.invalidate_caches()
    yield plugin_dir
    for name in list(sys.modules):
        if name.split(".")[0] in PLUGIN_MODULES:
            del sys.modules[name]


def fakechip() -> Platform:
    return next(r.platform for r in probe_all() if r.source == "plugin:fakechip")


def test_plugins_are_reported(installed):
    reg = build_registry()
    plugins = {p.name: p for p in reg.plugins}
    assert plugins["fakechip"].loaded and plugins["fakechip"].reason == "registered 2 implementation(s)"
    assert not plugins["brokenchip"].loaded
    assert "libbroken_vendor_sdk" in plugins["brokenchip"].reason
    assert plugins["brokenchip"].value == "broken_turnout_plugin:register"
    assert "vendor.fakechip" in reg.impl_ids("silu_and_mul") and "vendor.fakechip" in reg.impl_ids("rms_norm")


def test_working_impl_chosen_broken_one_reported(installed):
    reg = build_registry()
    platform = fakechip()
    table = resolve(platform, Policy.parse("prefer=vendor"), reg)
    assert table.chosen("silu_and_mul") == "vendor.fakechip"
    rms = table.resolutions["rms_norm"]
    cand = rms.candidate("vendor.fakechip")
    assert not cand.available and cand.source == "plugin:fakechip"
    assert "import fakechip_turnout.broken_kernels failed" in cand.reason
    assert "libfakechip_rt.so" in cand.reason
    assert rms.chosen not in (None, "vendor.fakechip")
    # The plugin's kernel runs, and then is the table attribute itself.
    x = torch.randn(3, 8)
    torch.testing.assert_close(table.silu_and_mul(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    kernels = sys.modules["fakechip_turnout.kernels"]
    assert kernels.CALLS == [x.shape] and table.silu_and_mul is kernels.silu_and_mul


def test_plugin_impl_does_not_serve_other_platforms(installed):
    reg = build_registry()
    cpu = detect_platform("cpu")
    table = resolve(cpu, Policy.parse("silu_and_mul=vendor.fakechip|reference.torch"), reg)
    assert table.chosen("silu_and_mul") == "reference.torch"
    assert "does not serve platform cpu" in table.resolutions["silu_and_mul"].candidate("vendor.fakechip").reason


def test_platform_plugin(installed):
    results = {r.source: r for r in probe_all()}
    assert results["plugin:fakechip"].reason == "fakechip driver 1.0 found"
    broken = results["plugin:brokenchip"]
    assert broken.platform is None and "libbroken_vendor_sdk" in broken.reason
    plat = detect_platform("fakechip")
    assert (plat.name, plat.device_type, plat.dist_backend) == ("fakechip", "cpu", "gloo")
    assert detect_platform().name == "fakechip"  # plugins come before the built-in probes
    assert detect_platform("cpu").name == "cpu"


def test_without_the_plugins_nothing_changes():
    reg = build_registry()
    assert not any(p.name in ("fakechip", "brokenchip") for p in reg.plugins)
    assert "vendor.fakechip" not in reg.impl_ids()


def _turnout_cmd():
    exe = Path(sys.executable).with_name("turnout")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "turnout.entrypoints.cli"]


def _run(plugin_dir, *args, **env):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.run(_turnout_cmd() + ["ops", *args], capture_output=True, text=True, env=e, timeout=120)


def test_turnout_ops_json_in_a_subprocess(plugin_dir):
    p = _run(plugin_dir, "--json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    by_op = {r["op"]: r for r in rows}
    assert by_op["silu_and_mul"]["chosen"] == "vendor.fakechip"  # platform fakechip, vendor first
    rms = {c["impl"]: c for c in by_op["rms_norm"]["candidates"]}
    assert rms["vendor.fakechip"]["available"] is False
    assert "libfakechip_rt.so" in rms["vendor.fakechip"]["reason"]
    assert by_op["rms_norm"]["chosen"] not in (None, "vendor.fakechip")
    for r in rows:
        assert {"op", "chosen", "candidates"} <= set(r)
        for c in r["candidates"]:
            assert isinstance(c["impl"], str) and isinstance(c["available"], bool) and isinstance(c["reason"], str)
    assert "Traceback" not in p.stderr


def test_turnout_ops_text_reports_broken_plugin(installed, monkeypatch, capsys):
    from turnout.entrypoints import cli

    monkeypatch.setenv("TURNOUT_OPS", "deny=vendor.fakechip")
    envs.reload()
    monkeypatch.setattr("turnout.ops.registry._default", None)  # scan the entry points afresh
    try:
        assert cli.main(["ops", "--op", "silu_and_mul,rms_norm"]) == 0
    finally:
        monkeypatch.setattr("turnout.ops.registry._default", None)
    out = capsys.readouterr().out
    assert "platform: fakechip" in out
    assert "brokenchip: FAILED: ModuleNotFoundError" in out and "libbroken_vendor_sdk" in out
    assert "fakechip: loaded: registered 2 implementation(s)" in out
    assert "vendor.fakechip [plugin:fakechip]  denied by policy (TURNOUT_OPS)" in out
