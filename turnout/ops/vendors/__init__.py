"""Optional native kernels per vendor.

Each vendor subpackage has a ``register(registry)`` that only declares implementations (string targets,
nothing heavy imported). A vendor whose registration module fails to import or to register is reported
in ``registry.plugins`` and disables only its own implementations; a vendor library that is missing at
probe time makes only the implementations that need it unavailable, with the reason.
"""

import importlib

VENDOR_PACKAGES = ("turnout.ops.vendors.cuda", "turnout.ops.vendors.cpu")


def register(registry) -> None:
    for name in VENDOR_PACKAGES:
        def register_one(view, name=name):
            importlib.import_module(name).register(view)

        registry.run_registration(f"builtin:{name}", register_one)
