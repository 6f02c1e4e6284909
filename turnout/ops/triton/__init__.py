"""Portable Triton kernels. Registered lazily: ``triton`` is imported only when a kernel is probed."""

from turnout.ops.spec import Impl

# The platforms whose Triton port runs these kernels; cpu only under TRITON_INTERPRET=1.
TRITON_PLATFORMS = ("cuda", "rocm", "maca", "xpu", "npu", "cpu")


def _check(platform):
    return platform.triton_usable()


# op name -> "module:function" of its Triton implementation
KERNELS: dict[str, str] = {}


def register(registry) -> None:
    for op, target in KERNELS.items():
        registry.add_impl(Impl(op=op, id="triton.default", target=f"turnout.ops.triton.{target}",
                               platforms=TRITON_PLATFORMS, priority=0, check=_check))
