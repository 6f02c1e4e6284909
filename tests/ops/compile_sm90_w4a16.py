"""Compile the w4a16 Triton kernels for sm90 without a GPU, in each branch their constexprs select (bf16, the
tiles the wrapper launches); one JSON line per variant. Run by tests/ops/test_compile_sm90_w4a16.py in a subprocess
without TRITON_INTERPRET."""

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from turnout.ops.triton import w4a16

B, F32, I64, U8 = "*bf16", "*fp32", "*i64", "*u8"


def _cases():
    types = {"x_ptr": B, "perm_ptr": I64, "qw_ptr": U8, "sz_ptr": B, "b_ptr": B, "y_ptr": B, "part_ptr": F32}
    for group in (32, 64, 128):
        for perm, bias, partial in ((False, True, False), (True, False, True)):
            yield (f"row group={group} perm={perm} bias={bias} partial={partial}", w4a16._row_kernel, types,
                   dict(GROUP=group, HAS_PERM=perm, HAS_BIAS=bias, PARTIAL=partial, BLOCK_K=max(group, 256)),
                   {"num_stages": 3})
    for block_m, group in ((16, 128), (64, 32)):
        for perm in (False, True):
            yield (f"gemm BLOCK_M={block_m} group={group} perm={perm}", w4a16._gemm_kernel, types,
                   dict(GROUP=group, HAS_PERM=perm, HAS_BIAS=True, UPCAST=False, PRECISION=None, BLOCK_M=block_m,
                        BLOCK_K=64), {"num_stages": 3})


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for label, kernel, types, consts, opts in _cases():
        row = {"label": label}
        try:
            signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts), target=target,
                                      options={"num_warps": 4, **opts})
            row.update(ok=True, sm90=".target sm_90" in compiled.asm["ptx"])
        except Exception as e:  # noqa: BLE001 - reported per kernel
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
