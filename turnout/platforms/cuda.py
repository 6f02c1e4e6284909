from turnout.platforms.platform import Platform


def probe() -> tuple[Platform | None, str]:
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        return None, f"torch not importable: {e}"
    if getattr(torch.version, "hip", None):
        return None, "this torch is a ROCm build"
    if not torch.version.cuda:
        return None, "this torch has no CUDA support (CPU build)"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    name = torch.cuda.get_device_name(0)
    from turnout.platforms.vendors import cuda_api_vendor

    vendor = cuda_api_vendor(name)
    if vendor is not None:  # a vendor build answering torch.cuda: its own platform serves it
        return None, f"device 0 is {name!r}: platform {vendor}, not NVIDIA CUDA"
    cap = torch.cuda.get_device_capability(0)
    return (
        Platform(
            name="cuda",
            device_type="cuda",
            dist_backend="nccl",
            vendor="cuda",
            triton_backend=True,
            description=f"{name} (sm_{cap[0]}{cap[1]}, CUDA {torch.version.cuda})",
        ),
        "ok",
    )
