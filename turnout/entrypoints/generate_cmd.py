def add_arguments(p) -> None:
    pass


def run(args) -> int:
    raise RuntimeError("not built yet")
