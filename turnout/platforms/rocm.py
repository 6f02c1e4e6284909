from turnout.platforms.platform import Platform


def probe() -> tuple[Platform | None, str]:
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        return None, f"torch not importable: {e}"
    if not getattr(torch.version, "hip", None):
        return None, "this torch is not a ROCm build"
    if not torch.cuda.is_available():
        return None, "ROCm build but no GPU visible"
    return (
        Platform(
            name="rocm",
            device_type="cuda",
            dist_backend="nccl",
            vendor="rocm",
            triton_backend=True,
            description=f"{torch.cuda.get_device_name(0)} (HIP {torch.version.hip})",
        ),
        "ok",
    )
