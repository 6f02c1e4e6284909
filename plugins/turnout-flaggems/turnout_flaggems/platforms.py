"""Where FlagGems serves turnout's ops, and the capability checks of its implementations.

FlagGems picks its backend itself when it imports (NVIDIA, MetaX, Iluvatar, Kunlunxin, Ascend, ... under
flag_gems/runtime/backend/). turnout's platform probes (turnout/platforms/) name those machines ``maca``,
``iluvatar``, ``kunlun`` and ``npu``, and FlagGems' ``arm`` backend runs on the host CPU (``cpu``, through a
Triton CPU build; on any other CPU its import fails and says why, which is what ``turnout ops`` then shows for
every implementation). Only ``cuda`` has been run here, so on the others the implementations
are offered, with a warning (once) that they are unverified there, for the machines where turnout has no
kernel of its own: run ``turnout ops --check`` there before trusting them.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("turnout_flaggems")

VERIFIED = ("cuda",)
UNVERIFIED = ("maca", "iluvatar", "kunlun", "npu", "cpu")
PLATFORMS = VERIFIED + UNVERIFIED

_warned: set[str] = set()


def serves(platform) -> tuple[bool, str]:
    """Every implementation's check: on an unverified platform it is available, and says so once."""
    if platform.name in UNVERIFIED and platform.name not in _warned:
        _warned.add(platform.name)
        logger.warning("vendor.flaggems on %s is unverified: FlagGems has a backend for it, but no conformance "
                       "run of this plugin there yet (turnout ops --check)", platform.name)
    return True, ""


def fp8(platform) -> tuple[bool, str]:
    """The fp8 kernels: e4m3fn matrix units, as turnout's own fp8 kernels require."""
    from turnout.ops.fp8_platform import check

    serves(platform)
    return check(platform) if platform.is_gpu else (False, "fp8 kernels need a GPU with e4m3fn units")


def sm90(platform) -> tuple[bool, str]:
    """FlagGems' cutlass_scaled_mm has a kernel for sm90 only (its sm89, sm100 and sm120 entries raise)."""
    ok, why = fp8(platform)
    if not ok:
        return ok, why
    import torch

    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return False, f"FlagGems' cutlass_scaled_mm has a kernel for sm90 only; this is sm{cap[0]}{cap[1]}"
    return True, ""
