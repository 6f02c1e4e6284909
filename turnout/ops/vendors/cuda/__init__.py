"""vendor.cuda: kernels that torch itself ships for NVIDIA GPUs."""


def register(registry) -> None:
    pass
