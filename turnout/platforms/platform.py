"""The Platform base: what the engine needs to know about the hardware it runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

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
        from turnout import envs

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
