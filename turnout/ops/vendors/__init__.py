"""Optional native kernels per vendor. Each vendor subpackage registers lazily; a vendor library that
fails to import disables only the implementations that need it."""

import importlib
import logging

logger = logging.getLogger(__name__)

VENDOR_PACKAGES = ("turnout.ops.vendors.cuda",)


def register(registry) -> None:
    for name in VENDOR_PACKAGES:
        mod = importlib.import_module(name)  # registration modules import nothing heavy
        mod.register(registry)
