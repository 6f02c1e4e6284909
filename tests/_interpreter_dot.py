"""The Triton interpreter's ``tl.dot``, one output row at a time.

The interpreter computes ``tl.dot`` with ``np.matmul``, i.e. the machine's BLAS. Some BLAS kernels give a row a
result that depends on where the row sits in the matrix (OpenBLAS 0.3.31 sgemm on an AMD EPYC: a row at position
8 of a 16-row tile differs from the same row at position 0 by ~1e-6), which the GPU's matrix units never do: each
output element there is a function of its own row and column. The batch-invariance tests (a row alone equals
the row in any batch) would then fail or pass by which CPU CI lands on. Here each row is its own product, so a
row's bits depend on its values only, on every machine. Installed by tests/conftest.py under the interpreter.
"""

from __future__ import annotations

import numpy as np


def _rowwise_matmul(a: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    if a.ndim == 2:
        if a.shape[0] == 1:
            return np.matmul(a, b)
        return np.concatenate([np.matmul(np.ascontiguousarray(a[i:i + 1]), b) for i in range(a.shape[0])])
    return np.stack([_rowwise_matmul(a[j], b[j], dtype) for j in range(a.shape[0])])  # a batched (3-D) dot


def install() -> bool:
    """Replace InterpreterBuilder.create_dot (same conversions as Triton's, row-wise product); False where this
    Triton's interpreter has another shape (then its own dot stays)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    import inspect

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "_rowwise", False):
        return original is not None
    expected = ["self", "a", "b", "d", "input_precision", "max_num_imprecise_acc"]
    if list(inspect.signature(original).parameters) != expected or not hasattr(interpreter, "_convert_float"):
        return False  # another Triton's interpreter: its own dot stays

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
            a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        return interpreter.TensorHandle(_rowwise_matmul(a_data, b_data, d.data.dtype) + d.data, d.dtype.scalar)

    create_dot._rowwise = True
    builder.create_dot = create_dot
    return True
