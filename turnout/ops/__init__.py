"""THE DISPATCH LAYER. Models and layers call kernels only through an OpTable from ``resolve``.

See docs/ops.md: adding an op, an implementation or a vendor plugin; the TURNOUT_OPS grammar; fallback.
"""

from turnout.ops.dispatch import OpFailedError, OpTable, OpUnavailableError, log_table, resolve
from turnout.ops.policy import Policy, PolicyError
from turnout.ops.registry import PluginReport, Registry, build_registry, default_registry
from turnout.ops.resolution import Candidate, Resolution
from turnout.ops.spec import KNOWN_FAMILIES, Impl, ImplUnavailable, OpSpec, SampleCase

__all__ = ["KNOWN_FAMILIES", "Candidate", "Impl", "ImplUnavailable", "OpFailedError", "OpSpec", "OpTable",
           "OpUnavailableError", "PluginReport", "Policy", "PolicyError", "Registry", "Resolution", "SampleCase",
           "build_registry", "default_registry", "log_table", "resolve"]
