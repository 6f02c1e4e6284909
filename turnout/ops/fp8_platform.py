"""Whether a platform has fp8 (e4m3fn) matrix units: the check of every fp8 kernel (Triton and vendor.cuda).

Where it fails, the fp8 ops run their references, which dequantise to float32 and multiply: correct on any
device, and the start-up line of the op table and of the quantisation (turnout/quant) says why."""

from __future__ import annotations

MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer


def check(platform) -> tuple[bool, str]:
    if not platform.is_gpu:  # host tensors: only the Triton interpreter runs kernels here (tests)
        return True, "host (interpreter)"
    import torch

    if platform.name != "cuda" or not torch.cuda.is_available():  # other vendors: not known to have them
        return False, f"{platform.name}: no NVIDIA device with e4m3fn fp8 units"
    if getattr(torch.version, "hip", None):
        return False, "ROCm: its fp8 is e4m3fnuz, not the checkpoints' e4m3fn"
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return False, f"device capability sm{cap[0]}{cap[1]} < sm89: no fp8 matrix units"
    return True, f"fp8 units on sm{cap[0]}{cap[1]}"
