"""The example's platform probe.

A real probe imports the vendor's torch extension, asks it for a device and returns a Platform, or
``(None, why)``: it never raises for a missing SDK or device (turnout reports the reason and detection
goes on). The example has no hardware: it stands in for a device on the host CPU, and only when
``EXAMPLE_VENDOR=1`` is set, so installing it does not take over detection on your machine.
"""

import os

from turnout.platforms import Platform


def probe():
    if os.environ.get("EXAMPLE_VENDOR") != "1":
        return None, "no example device (EXAMPLE_VENDOR=1 stands one in on the host CPU)"
    threads = os.cpu_count() or 1
    return Platform(
        name="example",          # what Impl(platforms=...) names
        device_type="cpu",       # the torch device type tensors live on
        dist_backend="gloo",     # torch.distributed backend
        vendor="example",
        triton_backend=False,    # no compiled Triton here (True would give it turnout's Triton kernels)
        family_order=("vendor", "reference", "triton"),
        description=f"example vendor device, standing in on the host CPU ({threads} threads)",
    ), "EXAMPLE_VENDOR=1"
