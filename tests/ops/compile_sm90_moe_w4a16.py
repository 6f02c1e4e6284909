"""Compile the moe_experts_w4a16 Triton kernels for sm90 without a GPU, in each branch their constexprs select (bf16,
the BLOCK_M values the wrapper launches, groups within one tile and across tiles, activation order); one JSON line per
variant. Run by tests/ops/test_compile_sm90_moe_w4a16.py in a subprocess without TRITON_INTERPRET."""

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from turnout.ops.triton import moe_w4a16

B, F32, I32, I64, U8 = "*bf16", "*fp32", "*i32", "*i64", "*u8"
TYPES = {"x_ptr": B, "qw_ptr": U8, "sz_ptr": B, "perm_ptr": I64, "act_ptr": B, "out_ptr": F32, "weights_ptr": F32,
         "sorted_pairs_ptr": I32, "block_expert_ptr": I32}


def _cases():
    for kernel in (moe_w4a16._gate_up_kernel, moe_w4a16._down_kernel):
        for block_m, group, perm in ((16, 128, False), (64, 32, True), (128, 64, False)):
            yield (f"{kernel.fn.__name__} BLOCK_M={block_m} group={group} perm={perm}", kernel,
                   dict(GROUP=group, HAS_PERM=perm, UPCAST=False, PRECISION=None, BLOCK_M=block_m, BLOCK_K=64),
                   {"num_stages": 3, "num_warps": 4 if block_m <= 64 else 8})


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for label, kernel, consts, opts in _cases():
        row = {"label": label}
        try:
            signature = {n: "constexpr" if n in consts else TYPES.get(n, "i32") for n in kernel.arg_names}
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts), target=target,
                                      options=opts)
            row.update(ok=True, sm90=".target sm_90" in compiled.asm["ptx"])
        except Exception as e:  # noqa: BLE001 - reported per kernel
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
