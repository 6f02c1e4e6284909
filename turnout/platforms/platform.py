"""The Platform base: what the engine needs to know about the hardware it runs on."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from turnout import envs

DEFAULT_FAMILY_ORDER = ("vendor", "triton", "reference")


@dataclass(frozen=True)
class Platform:
    """A hardware platform.

    ``name`` is what op implementations list in their ``platforms`` (``cpu``, ``cuda``, ``rocm``,
    ``maca``, ``npu``, ``xpu``, ``kunlun``, ...). ``device_type`` is the torch device type used to
    place tensors (MetaX exposes itself as ``cuda``). ``vendor`` names the ``vendor.<vendor>``
    implementations that are native here. ``triton_backend`` says whether compiled Triton kernels
    run on this device (on CPU only the interpreter runs them, which is for tests).
    ``dist_backend`` is the torch.distributed backend (nccl, hccl, xccl, bkcl, gloo).
    ``family_order`` and ``ops_policy`` are the platform's default op policy: the family order, and a
    policy string (docs/ops.md grammar) applied under the engine config and ``TURNOUT_OPS``.
    """

    name: str
    device_type: str
    dist_backend: str
    vendor: str | None = None
    triton_backend: bool = False
    family_order: tuple[str, ...] = DEFAULT_FAMILY_ORDER
    ops_policy: str = ""
    description: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def device(self, index: int | None = None):
        import torch

        if self.device_type == "cpu" or index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, index)

    @property
    def takes_triton(self) -> bool:
        """Whether Triton kernels are candidates here, from this platform's own declaration: it has a
        compiled Triton backend, or its tensors live on the host (where the Triton interpreter runs them,
        for tests; ``triton_usable`` then says whether TRITON_INTERPRET=1 is set)."""
        return self.triton_backend or self.device_type == "cpu"

    @property
    def is_gpu(self) -> bool:
        return self.device_type != "cpu"

    def triton_usable(self) -> tuple[bool, str]:
        """Whether Triton kernels can run on this platform's tensors right now."""
        if self.triton_backend:
            return True, "compiled Triton backend"
        if envs.get().triton_interpret:
            return True, "TRITON_INTERPRET=1 (interpreter, for tests)"
        return False, f"Triton has no backend for {self.name} (TRITON_INTERPRET=1 runs the interpreter)"

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        import torch

        mod = getattr(torch, self.device_type, None)
        if mod is not None and hasattr(mod, "mem_get_info"):
            return mod.mem_get_info()
        raise NotImplementedError(f"{self.name}: no memory query")

    def synchronize(self) -> None:
        import torch

        mod = getattr(torch, self.device_type, None)
        if mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()

    def supports_graphs(self) -> bool:
        return self.name in ("cuda", "rocm")

    def pdl_enabled(self, device=None) -> bool:
        """Whether Triton kernels launched on ``device`` (default: this platform's first) use programmatic
        dependent launch (turnout/ops/triton/_pdl.py): see ``triton_pdl_enabled``."""
        return self.is_gpu and triton_pdl_enabled(self.device(0) if device is None else device)


def triton_pdl_enabled(device) -> bool:
    """Whether Triton kernels on ``device`` launch with programmatic dependent launch: a CUDA device of
    sm90 or later, a Triton that has the gdc intrinsics and the ``launch_pdl`` option, ``TURNOUT_PDL`` on
    and not the interpreter. The kernels (turnout/ops/triton/_pdl.py) and the engine both ask here; a kernel
    launch asks too, so the common path is two attribute reads and a cached call."""
    if device.type != "cuda" or not envs.get().pdl:
        return False
    if device.index is None:
        import torch

        return _pdl_supported(torch.cuda.current_device())
    return _pdl_supported(device.index)


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    import torch

    if envs.get().triton_interpret or torch.version.hip:
        return False
    try:  # Triton >= 3.3 (NVIDIA backend)
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:  # older Triton or another backend: PDL stays off
        return False
    if torch.cuda.get_device_capability(device_index) < (9, 0):
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
