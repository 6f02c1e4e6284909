from turnout.platforms.detect import detect_platform, probe_all
from turnout.platforms.platform import Platform

__all__ = ["Platform", "detect_platform", "probe_all"]
