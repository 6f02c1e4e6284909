"""vendor.cpu: CPU paths through torch's own optimised kernels (SDPA's flash kernel for CPU, argmax).

Only the platform ``cpu``; nothing here is imported until probed.
"""

from turnout.ops.spec import Impl

OPS = {"paged_attention": "attention:paged_attention", "sample": "sampling:sample"}


def register(registry) -> None:
    for op, target in OPS.items():
        if op in registry.ops:
            registry.add_impl(Impl(op=op, id="vendor.cpu", target=f"turnout.ops.vendors.cpu.{target}",
                                   platforms=("cpu",), priority=0))
