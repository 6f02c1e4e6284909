from turnout.platforms.platform import Platform


def probe() -> tuple[Platform | None, str]:
    import os

    threads = os.cpu_count() or 1
    return (
        Platform(
            name="cpu",
            device_type="cpu",
            dist_backend="gloo",
            vendor="cpu",
            triton_backend=False,
            # Compiled Triton does not run on CPU; the interpreter is for tests only.
            family_order=("vendor", "reference", "triton"),
            description=f"CPU ({threads} threads)",
        ),
        "always available",
    )
