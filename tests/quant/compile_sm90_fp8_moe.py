"""Compile the fp8 MoE expert kernels for sm90 as the H200 runs them (fp8 weights, bf16 activations, PDL on where
they take part), without a GPU; one JSON line per kernel variant.

Run by tests/quant/test_compile_sm90_fp8_moe.py in a subprocess without TRITON_INTERPRET (under the interpreter
``@triton.jit`` gives functions that cannot be compiled)."""

import inspect
import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from turnout.ops.reference.fp8 import MIN_SCALE
from turnout.ops.triton import moe_fp8, moe_fp8_decode, moe_fp8_one_token

B, F8, F32, I32 = "*bf16", "*fp8e4nv", "*fp32", "*i32"
PDL = {"PDL": True}


def _cases():
    gate_up = {"x_ptr": B, "w_ptr": F8, "ws_ptr": F32, "aq_ptr": F8, "as_ptr": F32}
    for by_slot in (True, False):
        yield (f"decode gate_up by_slot={by_slot}", moe_fp8_decode._fp8_gate_up_kernel, {**gate_up, "ids_ptr": I32},
               dict(SCAN=128, BLOCK_M=16, BY_SLOT=by_slot, MIN_S=MIN_SCALE, ROUND_E4M3=False, **PDL),
               {"num_stages": 4 if by_slot else 3})
        yield (f"decode down by_slot={by_slot}", moe_fp8_decode._fp8_down_kernel,
               {"aq_ptr": F8, "as_ptr": F32, "w_ptr": F8, "ws_ptr": F32, "weights_ptr": F32, "out_ptr": F32,
                "ids_ptr": I32}, dict(SCAN=128, BLOCK_M=16, BLOCK_N=64 if by_slot else 128, BY_SLOT=by_slot, **PDL),
               {"num_stages": 3})
    cfg = moe_fp8_decode.DEFAULT
    for label, slots, x in (("qdq hidden row", False, B), ("qdq activations", True, F32)):
        yield (label, moe_fp8_one_token._qdq_rows_kernel, {"x_ptr": x, "y_ptr": F32, "ids_ptr": I32},
               dict(SLOTS=slots, MIN_S=MIN_SCALE, ROUND_E4M3=False), {})
    yield ("one-token gate_up", moe_fp8_one_token._fp8_one_token_gate_up_kernel,
           {"x_ptr": F32, "w_ptr": F8, "ws_ptr": F32, "act_ptr": F32, "ids_ptr": I32},
           dict(BLOCK_N=cfg.block_n_one_up, BLOCK_K=cfg.block_k_one_up, **PDL),
           {"num_warps": cfg.num_warps_one_up, "num_stages": cfg.num_stages_one_up})
    yield ("one-token down", moe_fp8_one_token._fp8_one_token_down_kernel,
           {"act_ptr": F32, "w_ptr": F8, "ws_ptr": F32, "weights_ptr": F32, "out_ptr": B, "ids_ptr": I32},
           dict(KP=8, BLOCK_N=cfg.block_n_one, BLOCK_K=cfg.block_k_one, **PDL),
           {"num_warps": cfg.num_warps_one, "num_stages": cfg.num_stages_one})
    for block_m, bn2, warps, stages in (moe_fp8.gemm_config(n, 128) for n in (1024, 4096, 8192, 65536)):
        yield (f"grouped gate_up BLOCK_M={block_m}", moe_fp8._gate_up_kernel,
               {**gate_up, "sorted_pairs_ptr": I32, "block_expert_ptr": I32},
               dict(BLOCK_M=block_m, MIN_S=MIN_SCALE, ROUND_E4M3=False), {"num_warps": warps, "num_stages": stages})
        yield (f"grouped down BLOCK_M={block_m}", moe_fp8._down_kernel,
               {"aq_ptr": F8, "as_ptr": F32, "w_ptr": F8, "ws_ptr": F32, "out_ptr": F32, "weights_ptr": F32,
                "sorted_pairs_ptr": I32, "block_expert_ptr": I32},
               dict(BLOCK_M=block_m, BLOCK_N=bn2), {"num_warps": warps, "num_stages": stages})


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for label, kernel, types, consts, opts in _cases():
        row = {"label": label}
        try:
            signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
            missing = [n for n, p in inspect.signature(kernel.fn).parameters.items() if n not in signature]
            assert not missing, missing
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts), target=target,
                                      options={"num_warps": 4, "launch_pdl": True, **opts})
            ptx = compiled.asm["ptx"]
            row.update(ok=True, sm90=".target sm_90" in ptx, waits="griddepcontrol.wait" in ptx,
                       pdl=bool(consts.get("PDL")), wgmma_e4m3=bool(re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)),
                       block_m=consts.get("BLOCK_M"), shared=compiled.metadata.shared)
        except Exception as e:  # noqa: BLE001 - reported per kernel
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
