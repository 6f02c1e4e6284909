"""The conformance suite: every available implementation of every op against the reference.

Inputs come from each op's generator (fresh random data per seed). Outputs the implementation
allocates are poisoned (torch fills uninitialised memory with NaN / max-int while the suite runs), and
mutated arguments start from random data, so that an element an implementation forgets to write is
caught, as is one it writes that it should not.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import types
from dataclasses import dataclass

import torch

from turnout import envs
from turnout.ops.reference._util import DTYPES, compare_tensors  # noqa: F401 - compare_tensors is public here


@dataclass
class CaseResult:
    op: str
    impl: str
    dtype: str
    case: str
    ok: bool
    max_error: float
    message: str = ""
    skipped: str = ""  # why this case says nothing about the implementation (then ok is False, not a failure)


@contextlib.contextmanager
def poisoned_allocations():
    """torch.empty & co. return NaN (floats) / max-int (ints) inside this block."""
    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _flatten(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _flatten(item)]
    return []


def _outputs(spec, case, result):
    """The tensors an op produced: its return value and the arguments it mutates."""
    outs = _flatten(result)
    if spec.mutates:
        bound = inspect.signature(spec.reference).bind(*case.args, **case.kwargs)
        for name in spec.mutates:
            outs += _flatten(bound.arguments[name])
    return outs


def run_case(spec, fn, case, dtype: str, platform=None) -> tuple[bool, float, str]:
    ref_case = copy.deepcopy(case)
    got_case = copy.deepcopy(case)
    with poisoned_allocations():
        ref_out = spec.reference(*ref_case.args, **ref_case.kwargs)
        try:
            got_out = fn(*got_case.args, **got_case.kwargs)
        except Exception as e:
            return False, float("inf"), f"raised {type(e).__name__}: {e}"
    if platform is not None:
        platform.synchronize()
    elif torch.cuda.is_available():
        torch.cuda.synchronize()
    ref_t, got_t = _outputs(spec, ref_case, ref_out), _outputs(spec, got_case, got_out)
    if spec.compare is not None:
        return spec.compare(ref_t, got_t, ref_case)
    atol, rtol = spec.tolerance.get(dtype, (1e-5, 1e-5))
    return compare_tensors(ref_t, got_t, atol, rtol)


@functools.lru_cache(maxsize=1)
def interpreter_bf16_dot_error() -> float | None:
    """Under TRITON_INTERPRET=1: the max error of a 16x16x16 bfloat16 ``tl.dot`` against torch in float32
    (None when not interpreting, or when the probe cannot run). The interpreter of Triton 3.x gets bfloat16
    dots wrong (garbage of order 1e10), so a kernel's bfloat16 failure there can be the interpreter's."""
    if not envs.get().triton_interpret:
        return None
    try:
        import triton
        import triton.language as tl

        def probe(A, B, C, N: tl.constexpr):
            rows = tl.arange(0, N)
            a = tl.load(A + rows[:, None] * N + rows[None, :])
            b = tl.load(B + rows[:, None] * N + rows[None, :])
            tl.store(C + rows[:, None] * N + rows[None, :], tl.dot(a, b))

        kernel = triton.jit(probe)
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(16, 16, generator=gen).bfloat16()
        b = torch.randn(16, 16, generator=gen).bfloat16()
        c = torch.zeros(16, 16)
        kernel[(1,)](a, b, c, N=16)
        return (c - a.float() @ b.float()).abs().max().item()
    except Exception:
        return None


def uses_tl_dot(fn) -> bool:
    """Whether ``fn``'s module, or a module of its package that it imports from, calls ``tl.dot``."""
    start = inspect.getmodule(fn)
    if start is None:
        return False
    package = start.__name__.rsplit(".", 1)[0]
    seen, todo = set(), [start]
    while todo:
        mod = todo.pop()
        if mod.__name__ in seen:
            continue
        seen.add(mod.__name__)
        try:
            if "tl.dot(" in inspect.getsource(mod):
                return True
        except (OSError, TypeError):
            pass
        for value in vars(mod).values():
            # a Triton kernel imported from a sibling module is a wrapper (its __module__ may be Triton's, under
            # the interpreter); the function it wraps names the module that holds the tl.dot
            name = value.__name__ if isinstance(value, types.ModuleType) else \
                getattr(getattr(value, "fn", value), "__module__", None)
            if isinstance(name, str) and name.startswith(package + ".") and name not in seen and name in sys.modules:
                todo.append(sys.modules[name])
    return False


def interpreter_skip_reason(fn, dtype: str) -> str:
    """Why a failed case of ``fn`` says nothing about it: a bfloat16 case of a kernel that calls tl.dot,
    under an interpreter whose bfloat16 tl.dot is wrong here. "" otherwise: the failure is real."""
    if dtype != "bfloat16":
        return ""
    err = interpreter_bf16_dot_error()
    if err is None or err <= 0.1 or not uses_tl_dot(fn):
        return ""
    return (f"the Triton interpreter's bfloat16 tl.dot is wrong (a 16x16 probe is off by {err:.2g}); "
            "a GPU checks these cases")


def iter_cases(spec, device, seed: int = 0):
    for dtype in spec.dtypes:
        gen = torch.Generator().manual_seed(seed)
        for case in spec.sample_inputs(device, DTYPES[dtype], gen):
            yield dtype, case


def run_conformance(table_or_registry, platform, ops: list[str] | None = None, seed: int = 0,
                    policy=None) -> list[CaseResult]:
    """Run every available non-reference implementation of each op (not denied by the policy) on its
    sample inputs, against the reference."""
    from turnout.ops.policy import Policy
    from turnout.ops.resolution import resolve_op

    registry = getattr(table_or_registry, "_registry", table_or_registry)
    policy = policy or getattr(table_or_registry, "policy", None) or Policy.from_sources(platform=platform)
    device = platform.device()
    results = []
    for op in ops or sorted(registry.ops):
        spec = registry.ops[op]
        res = resolve_op(op, registry, platform, policy)
        for cand in res.candidates:
            if not cand.available or cand.impl == "reference.torch":
                continue
            for dtype, case in iter_cases(spec, device, seed):
                ok, err, msg = run_case(spec, cand.fn, case, dtype, platform)
                skipped = "" if ok else interpreter_skip_reason(cand.fn, dtype)
                results.append(CaseResult(op, cand.impl, dtype, case.label, ok, err, msg, skipped))
    return results
