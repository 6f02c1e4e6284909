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

# Order matters: the first available wins. ROCm, MetaX and Iluvatar builds also answer torch.cuda.
BUILTIN_PROBES: dict[str, Callable[[], tuple[Platform | None, str]]] = {
    "rocm": rocm.probe,
    "maca": vendors.probe_maca,
    "iluvatar": vendors.probe_iluvatar,
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

    Each entry point loads to a Platform, or to a callable returning a Platform, None, or
    ``(Platform | None, reason)``. A plugin that fails to load is reported, never raised.
    """
    found = []
    try:
        eps = list(metadata.entry_points(group=PLATFORM_ENTRY_POINT_GROUP))
    except Exception as e:  # a corrupt installed distribution must not stop detection
        return [(f"<{PLATFORM_ENTRY_POINT_GROUP}>", None, f"cannot list entry points: {type(e).__name__}: {e}")]
    for ep in eps:
        try:
            obj = ep.load()
        except (Exception, SystemExit) as e:
            found.append((ep.name, None, f"plugin {ep.value} failed to load: {type(e).__name__}: {e}"))
            continue

        def probe(obj=obj, ep=ep):
            res = obj if isinstance(obj, Platform) else obj()
            if isinstance(res, Platform):
                return res, "provided by plugin"
            if res is None:
                return None, "plugin probe returned None"
            if (isinstance(res, tuple) and len(res) == 2 and isinstance(res[1], str)
                    and (res[0] is None or isinstance(res[0], Platform))):
                return res
            return None, f"plugin {ep.value} returned {type(res).__name__}, not a Platform or (Platform, reason)"

        found.append((ep.name, probe, ""))
    return found


def probe_all() -> list[ProbeResult]:
    """Every probe's answer, plugins first: what ``turnout ops`` shows and detection picks from."""
    results = []
    for name, probe, err in _plugin_probes():
        if probe is None:
            results.append(ProbeResult(f"plugin:{name}", None, err))
            continue
        try:
            plat, reason = probe()
        except (Exception, SystemExit) as e:
            plat, reason = None, f"plugin probe raised {type(e).__name__}: {e}"
        results.append(ProbeResult(f"plugin:{name}", plat, reason))
    for name, probe in BUILTIN_PROBES.items():
        try:
            plat, reason = probe()
        except (Exception, SystemExit) as e:
            plat, reason = None, f"probe raised {type(e).__name__}: {e}"
        results.append(ProbeResult(f"builtin:{name}", plat, reason))
    return results


def detect_platform(device: str = "auto", results: list[ProbeResult] | None = None) -> Platform:
    """The platform to run on. ``device`` is "auto", a platform name ("cuda", "cpu", "npu", ...)
    or a torch device type ("cuda:1" also works)."""
    results = probe_all() if results is None else results
    if device in (None, "auto"):
        for r in results:
            if r.platform is not None:
                return r.platform
    else:
        want = str(device).split(":")[0]
        found = [r.platform for r in results if r.platform is not None]
        # A platform name first ("cpu" is the cpu platform, not a plugin's chip that keeps tensors on
        # the CPU), then a torch device type ("cuda" on a ROCm or MetaX machine).
        for plat in [p for p in found if p.name == want] + [p for p in found if p.device_type == want]:
            return plat
        tried = "; ".join(f"{r.source}: {r.reason}" for r in results)
        raise RuntimeError(f"device={device!r} requested but no such platform is available ({tried})")
    raise RuntimeError("no platform available")  # cpu always is; unreachable
