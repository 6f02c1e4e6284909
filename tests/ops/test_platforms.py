"""Platform detection: real on this machine (cpu), and vendor probes driven by fake modules."""

import importlib
import sys
import textwrap
import types

import pytest
import torch

from turnout.ops import Policy
from turnout.platforms import Platform, cpu, cuda, detect, detect_platform, probe_all, rocm, vendors

needs_cpu_only_torch = pytest.mark.skipif(torch.cuda.is_available() or bool(torch.version.cuda)
                                          or bool(getattr(torch.version, "hip", None)),
                                          reason="checks the messages of a CPU-only torch")


def test_cpu_is_detected_here():
    plat = detect_platform()
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert (plat.name, plat.device_type, plat.dist_backend) == ("cpu", "cpu", "gloo")
    # Only the Triton interpreter runs on CPU: the reference comes before it.
    assert plat.family_order.index("reference") < plat.family_order.index("triton")
    assert not plat.triton_backend and not plat.is_gpu
    assert plat.device() == torch.device("cpu")


@needs_cpu_only_torch
def test_gpu_probes_say_why_not():
    plat, why = cuda.probe()
    assert plat is None and why == "this torch has no CUDA support (CPU build)"
    plat, why = rocm.probe()
    assert plat is None and why == "this torch is not a ROCm build"
    for probe in (vendors.probe_maca, vendors.probe_iluvatar):
        plat, why = probe()
        assert plat is None and "torch.cuda.is_available() is False" in why


def test_every_probe_reports_a_reason():
    results = probe_all()
    sources = [r.source for r in results]
    for name in ("rocm", "maca", "iluvatar", "cuda", "npu", "xpu", "kunlun", "cpu"):
        assert f"builtin:{name}" in sources
    assert all(r.reason for r in results)
    assert sources.index("builtin:maca") < sources.index("builtin:cuda")  # CUDA-API vendors before cuda
    assert sources.index("builtin:iluvatar") < sources.index("builtin:cuda")


def test_unknown_device_request_names_what_was_tried():
    with pytest.raises(RuntimeError) as e:
        detect_platform("npu")
    assert "device='npu'" in str(e.value) and "builtin:npu" in str(e.value)


# --- vendor probes with fakes -------------------------------------------------------------------

def _device_api(available=True, count=1, **extra):
    api = types.SimpleNamespace(is_available=lambda: available, device_count=lambda: count, **extra)
    return api


@pytest.fixture
def fake_module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name, text):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
        monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.invalidate_caches()
    yield write
    for name in ("torch_npu", "torch_xmlir"):
        sys.modules.pop(name, None)


def test_npu_whose_import_fails(fake_module_dir):
    fake_module_dir("torch_npu", 'raise ImportError("libascend_hal.so: cannot open shared object file")\n')
    plat, why = vendors.probe_npu()
    assert plat is None
    assert "torch_npu" in why and "libascend_hal.so" in why
    assert detect_platform().name != "npu"


def test_npu_that_works(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", _device_api(count=8), raising=False)
    plat, why = vendors.probe_npu()
    assert why == "ok"
    assert (plat.name, plat.device_type, plat.dist_backend, plat.vendor) == ("npu", "npu", "hccl", "ascend")
    assert detect_platform("npu") == plat
    assert detect_platform().name == "npu" or torch.cuda.is_available()


def test_npu_with_no_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", _device_api(available=False, count=0), raising=False)
    plat, why = vendors.probe_npu()
    assert plat is None and "no NPU is available" in why


def test_renamed_vendor_api_does_not_break_detection_seed_002(monkeypatch):
    # The vendor renamed device_count -> get_device_count: the probe says so; detection goes on.
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    renamed = types.SimpleNamespace(is_available=lambda: True, get_device_count=lambda: 8)
    monkeypatch.setattr(torch, "npu", renamed, raising=False)
    plat, why = vendors.probe_npu()
    assert plat is None and "torch.npu.device_count is missing" in why
    # A probe that raises outright (an unconditional `from x import RenamedClass`) is contained too.
    def exploding():
        raise ImportError("cannot import name 'FusedMoE' from 'vendor_sdk.layers' (did you mean FusedMoEFactory?)")
    monkeypatch.setitem(detect.BUILTIN_PROBES, "npu", exploding)
    results = {r.source: r for r in probe_all()}
    assert "probe raised ImportError" in results["builtin:npu"].reason
    assert "FusedMoEFactory" in results["builtin:npu"].reason
    assert detect_platform().name in ("cpu", "cuda", "rocm")


def test_kunlun(monkeypatch):
    mod = types.ModuleType("torch_xmlir")
    mod.xpu = _device_api(count=2)
    monkeypatch.setitem(sys.modules, "torch_xmlir", mod)
    plat, _ = vendors.probe_kunlun()
    assert (plat.name, plat.dist_backend, plat.vendor) == ("kunlun", "bkcl", "kunlun")
    del mod.xpu
    plat, why = vendors.probe_kunlun()
    assert plat is None and "torch_xmlir does not provide torch.xpu" in why


def test_intel_xpu(monkeypatch):
    monkeypatch.setattr(torch, "xpu", _device_api(count=1), raising=False)
    plat, _ = vendors.probe_xpu()
    assert (plat.name, plat.device_type, plat.dist_backend) == ("xpu", "xpu", "xccl")


@pytest.mark.parametrize("device_name,expected", [("Iluvatar BI-V150", "iluvatar"), ("MetaX C550", "maca")])
def test_cuda_api_vendors_by_device_name(monkeypatch, device_name, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: device_name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # such builds answer as CUDA too
    monkeypatch.setattr(torch.version, "hip", None)
    # The cuda probe declines the vendor's device, so that "--device cuda" finds the vendor platform.
    assert cuda.probe() == (None, f"device 0 is {device_name!r}: platform {expected}, not NVIDIA CUDA")
    plat = detect_platform()
    assert plat.name == expected and plat.device_type == "cuda" and plat.dist_backend == "nccl"
    assert plat.triton_backend and plat.family_order == ("vendor", "triton", "reference")
    assert detect_platform("cuda").name == expected  # asked for by torch device type
    other = {"iluvatar": vendors.probe_maca, "maca": vendors.probe_iluvatar}[expected]
    assert other()[0] is None and device_name in other()[1]


def test_platform_default_policy_is_used():
    plat = Platform(name="chip", device_type="cpu", dist_backend="gloo", family_order=("triton", "vendor", "reference"),
                    ops_policy="deny=vendor.cuda")
    pol = Policy.from_sources(env={}, platform=plat)
    assert pol.deny == {"vendor.cuda"} and pol.family_order(plat)[0] == "triton"


def test_cpu_probe_is_always_available():
    plat, why = cpu.probe()
    assert plat.name == "cpu" and why == "always available"


# --- Triton kernels follow the platform's own declaration, not a list of names ------------------

def _resolve_on(plat):
    from turnout.ops import build_registry, resolve

    registry = build_registry(plugins=False)
    return registry, resolve(plat, Policy.from_sources(env={}, platform=plat), registry)


def _triton_ops(registry):
    from turnout.ops import triton as triton_impls

    # the fp8 kernels also need e4m3fn units (turnout/ops/fp8_platform.py), which these platforms do not declare
    return {op for op in triton_impls.KERNELS if op in registry.ops and op not in triton_impls.FP8_OPS}


def _assert_triton_chosen(plat):
    registry, table = _resolve_on(plat)
    kernels = _triton_ops(registry)
    assert kernels, "no Triton kernel registered"
    for op, spec in registry.ops.items():
        lacks = spec.requires is not None and not spec.requires(plat)[0]
        if (op not in kernels or lacks) and spec.optional and table.chosen(op) is None:
            continue  # an optional op nothing on this platform serves (swap_layer_async needs device streams)
        assert table.chosen(op) == ("triton.default" if op in kernels else "reference.torch"), op


@pytest.mark.parametrize("device_name", ["Iluvatar BI-V150", "MetaX C550"])
def test_builtin_vendor_declaring_triton_gets_the_triton_kernels(monkeypatch, device_name):
    # Iluvatar was left out of a list of Triton platforms and so ran the reference everywhere.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: device_name)
    plat = detect_platform()
    assert plat.triton_backend and plat.takes_triton
    _assert_triton_chosen(plat)


def test_new_platform_declaring_triton_gets_the_triton_kernels():
    # A platform turnout has never heard of (a plugin's, say): its declaration is all that counts.
    plat = Platform(name="newchip", device_type="newchip", dist_backend="nccl", triton_backend=True)
    _assert_triton_chosen(plat)


def test_platform_without_triton_backend_is_not_served_by_triton():
    plat = Platform(name="plainchip", device_type="plainchip", dist_backend="gloo", triton_backend=False)
    assert not plat.takes_triton
    registry, table = _resolve_on(plat)
    for op in _triton_ops(registry):
        spec = registry.ops[op]
        if spec.optional and spec.requires is not None and not spec.requires(plat)[0]:
            assert table.chosen(op) is None  # what the op needs is missing (device streams): nothing serves it
            continue
        assert table.chosen(op) == "reference.torch"
        cand = table.resolutions[op].candidate("triton.default")
        assert not cand.available
        assert cand.reason == "does not serve platform plainchip (serves platforms that take Triton kernels)"
    kunlun = Platform(name="kunlun", device_type="xpu", dist_backend="bkcl", triton_backend=False)
    assert not kunlun.takes_triton


def test_host_platform_takes_triton_only_under_the_interpreter(monkeypatch):
    from turnout.ops import build_registry
    from turnout.ops.resolution import resolve_op

    plat = cpu.probe()[0]
    assert plat.takes_triton and not plat.triton_backend  # a candidate, ranked after the reference
    from turnout import envs

    registry = build_registry(plugins=False)
    try:
        for interpret, available in (("1", True), ("0", False)):
            monkeypatch.setenv("TRITON_INTERPRET", interpret)
            envs.reload()  # read once per process; re-read here
            cand = resolve_op("silu_and_mul", registry, plat, Policy()).candidate("triton.default")
            assert cand.available is available, cand.reason
    finally:
        monkeypatch.undo()
        envs.reload()
