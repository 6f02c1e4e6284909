"""turnout's example vendor plugin: implementations of two ops for the ``example`` platform.

``register`` runs at start-up in every turnout process that has this package installed, so it only
declares: string targets, nothing imported. ``kernels.py`` is imported when an implementation is probed;
if it failed to import (a vendor SDK missing), only these two implementations would be unavailable, with
the import error as the reason, and turnout would run the next candidate.
"""

from turnout.ops import Impl

PLATFORM = "example"  # the name platform.py's Platform has: these implementations serve only it

# op -> "module:function" of its implementation; each has exactly the reference's signature
KERNELS = {
    "silu_and_mul": "turnout_example_vendor.kernels:silu_and_mul",
    "fused_add_rms_norm": "turnout_example_vendor.kernels:fused_add_rms_norm",
}


def register(registry) -> None:
    for op, target in KERNELS.items():
        if op in registry.ops:  # an older turnout without the op: skip it rather than fail the plugin
            registry.add_impl(Impl(op=op, id=f"vendor.{PLATFORM}", target=target, platforms=(PLATFORM,)))
