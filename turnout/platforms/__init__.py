from turnout.platforms.detect import ProbeResult, detect_platform, probe_all
from turnout.platforms.platform import Platform

__all__ = ["Platform", "ProbeResult", "detect_platform", "probe_all"]
