"""Compile the decode-step Triton kernels for sm90 with PDL on, without a GPU; one JSON line per kernel.

Run by tests/ops/test_compile_sm90.py in a subprocess without TRITON_INTERPRET (under the interpreter
``@triton.jit`` gives functions that cannot be compiled)."""

import inspect
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from turnout.ops.triton import (
    activation,
    attention,
    cache,
    linear,
    moe_biased_decode,
    moe_decode,
    moe_one_token,
    norm,
    rotary,
    routing,
    sampling,
    swap,
)

B, F32, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"
PDL = {"PDL": True}


def _cases():
    for neox in (True, False):
        for write_cache in (True, False):
            yield (f"qk_norm_rotary neox={neox} cache={write_cache}", rotary._qk_norm_rotary_kernel,
                   {**dict.fromkeys(("Q", "K", "QW", "KW", "V", "KC", "VC"), B), "POS": I64, "CS": F32,
                    "SLOTS": I64, "eps": "fp32"},
                   dict(D=128, ROT=64, IS_NEOX=neox, HALF=32, BLOCK_H=8, BLOCK_HALF=32, BLOCK_TAIL=64, BS=16,
                        BLOCK_D=128, WRITE_CACHE=write_cache, **PDL), {})
    yield ("rotary", rotary._rotary_kernel, {"POS": I64, "Q": B, "K": B, "CS": F32},
           dict(IS_NEOX=True, HALF=64, BLOCK_H=8, BLOCK_HALF=64, **PDL), {})
    for dot in (True, False):
        for even in (True, False):
            for fuse_norm, res in ((False, False), (True, True), (True, False)):
                yield (f"small_m dot={dot} even_k={even} norm={fuse_norm} residual={res}", linear._small_m_kernel,
                       {**dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "y_ptr", "r_ptr", "nw_ptr", "ro_ptr", "no_ptr"), B),
                        "eps": "fp32"},
                       dict(HAS_BIAS=True, BLOCK_M=16 if dot else 1, BLOCK_N=32 if dot else 4,
                            BLOCK_K=128 if dot else 2048, EVEN_K=even, USE_DOT=dot, PRECISION=None, UPCAST=False,
                            NORM=fuse_norm, HAS_RES=res, BLOCK_S=256 if dot else 4096, **PDL),
                       {"num_stages": 4 if dot else 3})  # as pick_config chooses for Qwen3-30B-A3B
    yield ("fused_add_rms_norm", norm._fused_add_rms_norm_kernel, {"X": B, "R": B, "W": B, "eps": "fp32"},
           dict(BLOCK=2048, **PDL), {"num_warps": 8})
    yield ("rms_norm", norm._rms_norm_kernel, {"X": B, "W": B, "OUT": B, "eps": "fp32"}, dict(BLOCK=2048, **PDL), {})
    yield ("silu_and_mul", activation._silu_and_mul_kernel, {"X": B, "OUT": B}, dict(BLOCK=1024, **PDL), {})
    yield ("reshape_and_cache", cache._reshape_and_cache_kernel,
           {"KEY": B, "VALUE": B, "KC": B, "VC": B, "SLOTS": I64},
           dict(BS=16, D=128, BLOCK_H=8, BLOCK_D=128, **PDL), {})
    for rope, qk_norm, neox, rot in ((False, False, True, 1), (True, True, True, 128), (True, False, False, 64)):
        yield (f"paged_attention split rope={rope} norm={qk_norm} neox={neox} rot={rot}", attention._paged_attn_kernel,
               {**dict.fromkeys(("Q", "K", "V", "O", "QW", "KW", "KN", "VN"), B), "BT": I32, "SEQ_LENS": I32,
                "QSL": I32, "WS_O": F32, "WS_LSE": F32, "qk_scale": "fp32", "POS": I64, "CS": F32, "SLOTS": I64,
                "eps": "fp32"},
               dict(G=8, G_TILE=8, NUM_HEAD_TILES=1, BLOCK_Q=1 if rope else 2, BLOCK_M=16, BLOCK_N=64, BS=16,
                    HEAD_D=128, D_PAD=128, SPLIT=True, PRECISION=None, ROPE=rope, HAS_NORM=qk_norm, IS_NEOX=neox,
                    ROT=rot, HALF=max(rot // 2, 1), **PDL), {})
    yield ("paged_attention decode one token", attention._paged_attn_kernel,
           {**dict.fromkeys(("Q", "K", "V", "O", "QW", "KW", "KN", "VN"), B), "BT": I32, "SEQ_LENS": I32,
            "QSL": I32, "WS_O": F32, "WS_LSE": F32, "qk_scale": "fp32", "POS": I64, "CS": F32, "SLOTS": I64,
            "eps": "fp32"},
           dict(G=8, G_TILE=8, NUM_HEAD_TILES=1, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64, BS=16, HEAD_D=128, D_PAD=128,
                SPLIT=True, PRECISION=None, ROPE=True, HAS_NORM=True, IS_NEOX=True, ROT=128, HALF=64,
                ONE_TOKEN=True, **PDL), {})
    fp8_cache = {**dict.fromkeys(("Q", "O", "QW", "KW", "KN", "VN"), B), "K": "*fp8e4nv", "V": "*fp8e4nv", "KS": F32,
                 "VS": F32, "BT": I32, "SEQ_LENS": I32, "QSL": I32, "WS_O": F32, "WS_LSE": F32, "qk_scale": "fp32",
                 "POS": I64, "CS": F32, "SLOTS": I64, "eps": "fp32"}
    yield ("paged_attention prefill, fp8 cache, float16 dots", attention._paged_attn_kernel,
           fp8_cache,
           dict(G=4, G_TILE=4, NUM_HEAD_TILES=1, BLOCK_Q=16, BLOCK_M=64, BLOCK_N=64, BS=16, HEAD_D=128, D_PAD=128,
                SPLIT=False, PRECISION=None, ROPE=False, HAS_NORM=False, IS_NEOX=True, ROT=1, HALF=1,
                FP8_KV=True, ROUND=False, F16_DOT=True, **PDL), {})
    yield ("paged_attention decode one token, fp8 cache, float16 dots, V pairs", attention._paged_attn_kernel,
           fp8_cache,
           dict(G=8, G_TILE=8, NUM_HEAD_TILES=1, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64, BS=16, HEAD_D=128, D_PAD=128,
                SPLIT=True, PRECISION=None, ROPE=True, HAS_NORM=True, IS_NEOX=True, ROT=128, HALF=64,
                ONE_TOKEN=True, FP8_KV=True, ROUND=False, F16_DOT=True, V_PAIRS=True, **PDL), {})
    variant_types = {**dict.fromkeys(("Q", "K", "V", "O", "QW", "KW", "KN", "VN"), B), "BT": I32, "SEQ_LENS": I32,
                     "QSL": I32, "WS_O": F32, "WS_LSE": F32, "qk_scale": "fp32", "POS": I64, "CS": F32, "SLOTS": I64,
                     "eps": "fp32", "SINKS": F32}
    yield ("paged_attention decode one token, window, soft-cap, sinks (split)", attention._paged_attn_kernel,
           variant_types,
           dict(G=8, G_TILE=8, NUM_HEAD_TILES=1, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64, BS=16, HEAD_D=96, D_PAD=128,
                SPLIT=True, PRECISION=None, ROPE=True, HAS_NORM=True, IS_NEOX=True, ROT=96, HALF=48,
                ONE_TOKEN=True, WINDOW=4096, SOFTCAP=50.0, HAS_SINKS=True, **PDL), {})
    yield ("paged_attention prefill, window, sinks", attention._paged_attn_kernel, variant_types,
           dict(G=4, G_TILE=4, NUM_HEAD_TILES=1, BLOCK_Q=16, BLOCK_M=64, BLOCK_N=64, BS=16, HEAD_D=64, D_PAD=64,
                SPLIT=False, PRECISION=None, ROPE=False, HAS_NORM=False, IS_NEOX=True, ROT=1, HALF=1,
                WINDOW=128, HAS_SINKS=True, **PDL), {})
    yield ("split_reduce sinks", attention._split_reduce_kernel, {"WS_O": F32, "WS_LSE": F32, "O": B, "SINKS": F32},
           dict(S_PAD=4, HEAD_D=96, D_PAD=128, HAS_SINKS=True, **PDL), {})
    for pdl in (PDL, {"PDL": 2}):  # 2: launches its dependent before it waits (TURNOUT_PDL_EARLY)
        yield (f"split_reduce PDL={pdl['PDL']}", attention._split_reduce_kernel, {"WS_O": F32, "WS_LSE": F32, "O": B},
               dict(S_PAD=4, HEAD_D=128, D_PAD=128, **pdl), {})
    yield ("route", routing._route_kernel,
           {"LOGITS": B, "BIAS": F32, "SCALE": F32, "W_OUT": F32, "ID_OUT": I32, "scaling": "fp32"},
           dict(K=8, K_PAD=8, BLOCK_E=128, SIGMOID=False, AFTER_TOPK=False, RENORM=True, HAS_BIAS=False, HAS_SCALE=False,
                **PDL), {"num_warps": 1})
    moe = dict(SCAN=16, BLOCK_M=16, BLOCK_K=128, BY_SLOT=True, EVEN_K=True, PRECISION=None, UPCAST=False, **PDL)
    yield ("moe decode gate_up", moe_decode._decode_gate_up_kernel,
           {"x_ptr": B, "w13_ptr": B, "act_ptr": B, "ids_ptr": I32}, dict(BLOCK_N=64, **moe), {"num_stages": 4})
    yield ("moe decode down", moe_decode._decode_down_kernel,
           {"act_ptr": B, "w2_ptr": B, "weights_ptr": F32, "out_ptr": F32, "ids_ptr": I32}, dict(BLOCK_N=128, **moe),
           {"num_stages": 3})
    yield ("moe decode one-token down", moe_one_token.one_token_down_kernel,
           {"act_ptr": B, "w2_ptr": B, "weights_ptr": F32, "out_ptr": B, "ids_ptr": I32},
           dict(KP=8, BLOCK_N=8, BLOCK_K=1024, EVEN_K=False, **PDL), {"num_stages": 4, "num_warps": 8})
    # sampling runs after the graph, without PDL (no wait expected)
    yield ("sample row stats", sampling._row_stats_kernel,
           {"LOGITS": F32, "PART_MAX": F32, "PART_ID": I32, "PART_MIN": F32}, dict(CHUNK=4096), {"num_warps": 8})
    yield ("sample", sampling._sample_kernel,
           {"LOGITS": F32, "TEMP": F32, "TOP_K": I32, "TOP_P": F32, "MIN_P": F32, "SEEDS": I64, "STEPS": I64,
            "OUT": I64, "PART_MAX": F32, "PART_ID": I32, "PART_MIN": F32}, dict(NC_PAD=64, BLOCK=4096),
           {"num_warps": 8})
    # the KV swap kernel (no PDL: it runs beside the forward on a side stream, or before it)
    yield ("swap layer", swap._swap_layer_kernel, {**dict.fromkeys(("SRC_K", "SRC_V", "DST_K", "DST_V"), "*i32"),
                                                   "MAP": I64}, dict(BLOCK=2048), {})
    yield ("moe sum slots", moe_decode._sum_slots_kernel, {"pair_out_ptr": F32, "ids_ptr": I32, "out_ptr": B},
           dict(KP=8, BLOCK_H=512, **PDL), {})
    # GPT-OSS's biased experts with the clamped SwiGLU (moe_experts_biased's decode path)
    yield ("moe biased decode gate_up", moe_biased_decode._gate_up_act_kernel,
           {"x_ptr": B, "w13_ptr": B, "b13_ptr": B, "act_ptr": B, "ids_ptr": I32, "alpha": "fp32", "limit": "fp32"},
           dict(BLOCK_N=64, HAS_BIAS=True, ACT=1, **moe), {"num_stages": 4})
    yield ("moe biased decode down", moe_biased_decode._down_bias_kernel,
           {"act_ptr": B, "w2_ptr": B, "b2_ptr": B, "weights_ptr": F32, "out_ptr": F32, "ids_ptr": I32},
           dict(BLOCK_N=128, HAS_BIAS=True, **moe), {"num_stages": 3})



def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for label, kernel, types, consts, opts in _cases():
        row = {"label": label}
        try:
            defaults = {n: p.default for n, p in inspect.signature(kernel.fn).parameters.items()
                        if p.default is not inspect.Parameter.empty}  # constexprs left at their defaults
            consts = {**defaults, **consts}
            signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts), target=target,
                                      options={"num_warps": 4, "launch_pdl": True, **opts})
            ptx = compiled.asm["ptx"]
            row.update(ok=True, sm90=".target sm_90" in ptx, waits="griddepcontrol.wait" in ptx,
                       pdl=bool(consts.get("PDL")))
        except Exception as e:  # noqa: BLE001 - reported per kernel
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
