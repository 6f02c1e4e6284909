"""Vendor platforms recognised through probes.

Each probe imports the vendor's torch extension (if installed) and asks it for a device. None of
these imports is unconditional: a missing or broken vendor package only makes its probe say why.
Vendors can also ship a full Platform through the ``turnout.platforms`` entry point group.
"""

from __future__ import annotations

import importlib

from turnout.platforms.platform import Platform


def _try_import(module: str):
    try:
        return importlib.import_module(module), ""
    except Exception as e:  # any failure of a vendor package disables only this probe
        return None, f"cannot import {module}: {type(e).__name__}: {e}"


def probe_maca() -> tuple[Platform | None, str]:
    """MetaX (MACA): a torch build whose CUDA API runs on MetaX GPUs."""
    import torch

    if not getattr(torch.version, "maca", None):
        return None, "torch.version.maca is not set (not a MetaX torch build)"
    if not torch.cuda.is_available():
        return None, "MetaX torch build but no device visible"
    return Platform(name="maca", device_type="cuda", dist_backend="nccl", vendor="metax",
                    triton_backend=True, description="MetaX GPU (MACA)"), "ok"


def probe_npu() -> tuple[Platform | None, str]:
    """Huawei Ascend through torch_npu."""
    mod, why = _try_import("torch_npu")
    if mod is None:
        return None, why
    import torch

    npu = getattr(torch, "npu", None)
    if npu is None or not callable(getattr(npu, "is_available", None)) or not npu.is_available():
        return None, "torch_npu imported but no NPU is available"
    # Ascend runs Triton through triton-ascend when it is installed.
    has_triton = _try_import("triton")[0] is not None
    return Platform(name="npu", device_type="npu", dist_backend="hccl", vendor="ascend",
                    triton_backend=has_triton, description="Ascend NPU"), "ok"


def probe_xpu() -> tuple[Platform | None, str]:
    """Intel GPUs through torch.xpu (built into torch >= 2.5)."""
    import torch

    xpu = getattr(torch, "xpu", None)
    if xpu is None or not callable(getattr(xpu, "is_available", None)):
        return None, "torch has no xpu module"
    if not xpu.is_available():
        return None, "torch.xpu.is_available() is False"
    return Platform(name="xpu", device_type="xpu", dist_backend="xccl", vendor="intel",
                    triton_backend=True, description="Intel XPU"), "ok"


def probe_kunlun() -> tuple[Platform | None, str]:
    """Kunlunxin XPU through torch_xmlir."""
    mod, why = _try_import("torch_xmlir")
    if mod is None:
        return None, why
    return Platform(name="kunlun", device_type="xpu", dist_backend="bkcl", vendor="kunlun",
                    triton_backend=False, description="Kunlunxin XPU"), "ok"
