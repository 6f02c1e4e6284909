"""Compile the MLA Triton kernels for sm90 at DeepSeek-V3's attention shape (latent 512 + 64, bf16 and fp8
caches, split and unsplit) with PDL on, without a GPU; one JSON line per variant.
Run by tests/ops/test_compile_sm90_mla.py in a subprocess (no TRITON_INTERPRET)."""

import inspect
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from turnout.ops.triton import mla

B, F32, I32, I64, FP8 = "*bf16", "*fp32", "*i32", "*i64", "*fp8e4nv"


def _cases():
    for fp8 in (False, True):
        for splits in (1, 4):
            types = {"Q_LAT": B, "Q_PE": B, "CACHE": FP8 if fp8 else B, "TABLES": I32, "SEQ_LENS": I32, "QSL": I32,
                     "TOKEN_SEQ": I64, "PROG_SEQ": I32, "PROG_TOK": I32, "S": F32, "OUT": F32 if splits > 1 else B, "LSE": F32, "sm_scale": "fp32"}
            yield (f"mla decode fp8={fp8} splits={splits}", mla._mla_decode_kernel, types,
                   dict(L=512, R=64, BS=16, BLOCK_H=16, BLOCK_L=512, BLOCK_R=64, BLOCK_N=32 if fp8 else 16,
                        NUM_SPLITS=splits, PRECISION=None, FP8_KV=fp8, PDL=True), {"num_warps": 8, "num_stages": 2})
        yield (f"mla prefill fp8={fp8} qb=2", mla._mla_decode_kernel, {**types, "OUT": B},
               dict(L=512, R=64, BS=16, BLOCK_H=16, BLOCK_L=512, BLOCK_R=64, BLOCK_N=32 if fp8 else 16, NUM_SPLITS=1,
                    PRECISION=None, QB=2, FP8_KV=fp8, PDL=True), {"num_warps": 8, "num_stages": 2})
    for fp8 in (False, True):
        yield (f"mla cache write fp8={fp8}", mla._mla_cache_kernel,
               {"KV_C": B, "K_PE": B, "CACHE": FP8 if fp8 else B, "SLOTS": I64, "S": F32},
               dict(L=512, R=64, BS=16, BLOCK_L=512, BLOCK_R=64, PDL=True, FP8_KV=fp8, ROUND=False), {})


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
                                      options={"num_warps": 4, "launch_pdl": True, **opts})
            ptx = compiled.asm["ptx"]
            row.update(ok=True, sm90=".target sm_90" in ptx, waits="griddepcontrol.wait" in ptx)
        except Exception as e:  # noqa: BLE001 - reported per kernel
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
