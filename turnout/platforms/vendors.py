"""Vendor platforms recognised through probes.

Each probe looks for the vendor's torch build or extension and asks it for a device. Nothing here is
imported unconditionally and nothing is assumed by name: a missing, broken or renamed vendor API only
makes its probe return ``(None, reason)``. Vendors can also ship a full Platform through
the ``turnout.platforms`` entry point group (see detect.py).
"""

from __future__ import annotations

import importlib

from turnout.platforms.platform import Platform


def _try_import(module: str):
    try:
        return importlib.import_module(module), ""
    except (Exception, SystemExit) as e:  # any failure of a vendor package disables only this probe
        return None, f"cannot import {module}: {type(e).__name__}: {e}"


def _device_api(torch_mod, attr: str, owner: str):
    """``torch.<attr>`` with callable is_available/device_count, or (None, reason)."""
    api = getattr(torch_mod, attr, None)
    if api is None:
        return None, f"{owner} does not provide torch.{attr}"
    for fn in ("is_available", "device_count"):
        if not callable(getattr(api, fn, None)):
            return None, f"{owner}: torch.{attr}.{fn} is missing (renamed API?)"
    return api, ""


def _cuda_device_name() -> tuple[str | None, str]:
    """The name of CUDA-API device 0 (vendor builds that reuse torch.cuda say who they are here)."""
    import torch

    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            return None, "torch.cuda.is_available() is False"
        return torch.cuda.get_device_name(0), ""
    except Exception as e:
        return None, f"torch.cuda query failed: {type(e).__name__}: {e}"


def cuda_api_vendor(device_name: str) -> str | None:
    """The platform name of a vendor whose torch build answers torch.cuda for its own GPUs ("maca",
    "iluvatar"), from the build and device 0's name; None for an NVIDIA device. The cuda probe declines
    these, so that ``--device cuda`` picks the vendor's platform by device type, not plain cuda."""
    import torch

    if getattr(torch.version, "maca", None) or "metax" in device_name.lower():
        return "maca"
    if "iluvatar" in device_name.lower():
        return "iluvatar"
    return None


def probe_maca() -> tuple[Platform | None, str]:
    """MetaX (MACA): a torch build whose CUDA API runs on MetaX GPUs."""
    import torch

    name, why = _cuda_device_name()
    maca = getattr(torch.version, "maca", None)
    if name is None:
        return None, why if not maca else f"MetaX torch build ({maca}) but {why}"
    if not maca and "metax" not in name.lower():
        return None, f"device 0 is {name!r}, not MetaX (and torch.version.maca is not set)"
    return Platform(name="maca", device_type="cuda", dist_backend="nccl", vendor="metax",
                    triton_backend=True, description=f"{name} (MACA {maca or 'unknown version'})"), "ok"


def probe_iluvatar() -> tuple[Platform | None, str]:
    """Iluvatar CoreX: a torch build whose CUDA API runs on Iluvatar GPUs (BI-V100/V150, MR-V100)."""
    name, why = _cuda_device_name()
    if name is None:
        return None, why
    if "iluvatar" not in name.lower():
        return None, f"device 0 is {name!r}, not Iluvatar"
    return Platform(name="iluvatar", device_type="cuda", dist_backend="nccl", vendor="iluvatar",
                    triton_backend=True, description=f"{name} (CoreX)"), "ok"


def probe_npu() -> tuple[Platform | None, str]:
    """Huawei Ascend through torch_npu."""
    mod, why = _try_import("torch_npu")
    if mod is None:
        return None, why
    import torch

    npu, why = _device_api(torch, "npu", "torch_npu")
    if npu is None:
        return None, why
    if not npu.is_available() or npu.device_count() < 1:
        return None, "torch_npu imported but no NPU is available"
    # Ascend compiles Triton kernels through triton-ascend, when it is installed.
    has_triton = importlib.util.find_spec("triton") is not None
    return Platform(name="npu", device_type="npu", dist_backend="hccl", vendor="ascend",
                    triton_backend=has_triton, description=f"Ascend NPU ({npu.device_count()} devices)"), "ok"


def probe_xpu() -> tuple[Platform | None, str]:
    """Intel GPUs through torch.xpu (built into torch >= 2.5)."""
    import torch

    xpu, why = _device_api(torch, "xpu", "this torch")
    if xpu is None:
        return None, why
    if not xpu.is_available():
        return None, "torch.xpu.is_available() is False"
    return Platform(name="xpu", device_type="xpu", dist_backend="xccl", vendor="intel",
                    triton_backend=True, description="Intel XPU"), "ok"


def probe_kunlun() -> tuple[Platform | None, str]:
    """Kunlunxin XPU through torch_xmlir (not yet verified on hardware: a vendor plugin can override)."""
    mod, why = _try_import("torch_xmlir")
    if mod is None:
        return None, why
    xpu, why = _device_api(mod, "xpu", "torch_xmlir")
    if xpu is None:
        return None, why
    if not xpu.is_available() or xpu.device_count() < 1:
        return None, "torch_xmlir imported but no Kunlun device is available"
    return Platform(name="kunlun", device_type="xpu", dist_backend="bkcl", vendor="kunlun",
                    triton_backend=False, description="Kunlunxin XPU"), "ok"
