"""Find the platform this process runs on: plugins first, then the built-in probes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Callable

from turnout.platforms import cpu, cuda, rocm, vendors
from turnout.platforms.platform import Platform

logger = logging.getLogger(__name__)

PLATFORM_ENTRY_POINT_GROUP = "turnout.platforms"

# Order matters: the first available wins. ROCm and MetaX builds also answer torch.cuda.
BUILTIN_PROBES: dict[str, Callable[[], tuple[Platform | None, str]]] = {
    "rocm": rocm.probe,
    "maca": vendors.probe_maca,
    "cuda": cuda.probe,
    "npu": vendors.probe_npu,
    "xpu": vendors.probe_xpu,
    "kunlun": vendors.probe_kunlun,
    "cpu": cpu.probe,
}


@dataclass(frozen=True)
class ProbeResult:
    source: str  # "builtin:<name>" or "plugin:<entry point>"
    platform: Platform | None
    reason: str


def _plugin_probes() -> list[tuple[str, Callable[[], tuple[Platform | None, str]] | None, str]]:
    """Entry points of group ``turnout.platforms``.

    Each entry point loads to a Platform, or to a callable returning a Platform or
    ``(Platform | None, reason)``. A plugin that fails to load is reported, never raised.
    """
    found = []
    for ep in metadata.entry_points(group=PLATFORM_ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as e:
            found.append((ep.name, None, f"plugin failed to load: {type(e).__name__}: {e}"))
            continue

        def probe(obj=obj):
            if isinstance(obj, Platform):
                return obj, "provided by plugin"
            res = obj()
            if isinstance(res, Platform) or res is None:
                return res, "provided by plugin" if res else "plugin probe returned None"
            return res

        found.append((ep.name, probe, ""))
    return found


def probe_all() -> list[ProbeResult]:
    results = []
    for name, probe, err in _plugin_probes():
        if probe is None:
            results.append(ProbeResult(f"plugin:{name}", None, err))
            continue
        try:
            plat, reason = probe()
        except Exception as e:
            plat, reason = None, f"plugin probe raised {type(e).__name__}: {e}"
        results.append(ProbeResult(f"plugin:{name}", plat, reason))
    for name, probe in BUILTIN_PROBES.items():
        try:
            plat, reason = probe()
        except Exception as e:
            plat, reason = None, f"probe raised {type(e).__name__}: {e}"
        results.append(ProbeResult(f"builtin:{name}", plat, reason))
    return results


def detect_platform(device: str = "auto") -> Platform:
    """The platform to run on. ``device`` is "auto", a platform name ("cuda", "cpu", "npu", ...)
    or a torch device type."""
    results = probe_all()
    if device in (None, "auto"):
        for r in results:
            if r.platform is not None:
                return r.platform
    else:
        want = str(device).split(":")[0]
        for r in results:
            if r.platform is not None and want in (r.platform.name, r.platform.device_type):
                return r.platform
        tried = "; ".join(f"{r.source}: {r.reason}" for r in results)
        raise RuntimeError(f"device={device!r} requested but no such platform is available ({tried})")
    raise RuntimeError("no platform available")  # cpu always is; unreachable
