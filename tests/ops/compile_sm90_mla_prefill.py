"""Compile the decompressed-prefill Triton kernels (turnout/ops/triton/mla_prefill.py) for sm90 at DeepSeek-V3's
shape (keys 128 + 64, values 128, latent 512 + 64; bf16, and an fp8 latent cache for the gather) with the launch
the wrapper chooses, without a GPU; one JSON line per variant with the shared memory the kernel asks for.
Run by tests/ops/test_compile_sm90_mla.py in a subprocess (no TRITON_INTERPRET)."""

import inspect
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from turnout.ops.triton import mla_prefill

B, F32, I32, FP8 = "*bf16", "*fp32", "*i32", "*fp8e4nv"


def _cases():
    for fp8 in (False, True):
        yield (f"gather fp8={fp8}", mla_prefill._gather_kernel,
               {"CACHE": FP8 if fp8 else B, "TABLES": I32, "SEQ_LENS": I32, "KSL": I32, "S": F32, "OUT": B},
               dict(W=576, BS=64, BLOCK_T=32, BLOCK_W=128, FP8_KV=fp8), {"num_warps": 4})
    d_a, d_b = mla_prefill.split_head_dim(192)
    for block_m in (16, 64):
        yield (f"varlen attention Dk 192 Dv 128 block_m={block_m}", mla_prefill._varlen_kernel,
               {"Q": B, "K": B, "V": B, "QSL": I32, "KSL": I32, "OUT": B, "sm_scale": "fp32"},
               dict(D_A=d_a, D_B=d_b, DK=192, DV=128, BLOCK_DV=128, BLOCK_M=block_m, BLOCK_N=64, PRECISION=None,
                    HAS_B=True), {"num_warps": 4, "num_stages": 2})


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for label, kernel, types, consts, opts in _cases():
        row = {"label": label}
        try:
            defaults = {n: p.default for n, p in inspect.signature(kernel.fn).parameters.items()
                        if p.default is not inspect.Parameter.empty}
            consts = {**defaults, **consts}
            signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts), target=target,
                                      options={"num_warps": 4, **opts})
            row.update(ok=True, sm90=".target sm_90" in compiled.asm["ptx"], cubin=bool(compiled.asm.get("cubin")),
                       shared=compiled.metadata.shared)
        except Exception as e:  # noqa: BLE001 - reported per kernel
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
