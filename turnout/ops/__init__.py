"""THE DISPATCH LAYER. Models and layers call kernels only through an OpTable from ``resolve``."""

from turnout.ops.dispatch import (OpFailedError, OpTable, OpUnavailableError, Resolution, log_table,
                                  resolve)
from turnout.ops.policy import Policy, PolicyError
from turnout.ops.registry import Registry, build_registry, default_registry
from turnout.ops.spec import Impl, ImplUnavailable, OpSpec, SampleCase

__all__ = ["Impl", "ImplUnavailable", "OpFailedError", "OpSpec", "OpTable", "OpUnavailableError", "Policy",
           "PolicyError", "Registry", "Resolution", "SampleCase", "build_registry", "default_registry",
           "log_table", "resolve"]
