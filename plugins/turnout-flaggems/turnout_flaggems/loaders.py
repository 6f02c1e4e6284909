"""One zero-argument loader per op (the ``Impl(factory=True)`` targets registered in __init__.py): each
imports FlagGems through library.load and returns the wrapper with ``gems=flag_gems`` bound. Made from the
declarations in __init__.OPS, so an op is declared in one place."""

from turnout_flaggems import OPS
from turnout_flaggems.library import loader

globals().update({op: loader(module, op, needs) for op, (module, needs, _, _) in OPS.items()})
