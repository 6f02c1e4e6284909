"""Portable Triton kernels. Registered lazily: ``triton`` is imported only when a kernel is probed."""

from turnout.ops.kv_cache import FP8_KV_OPS
from turnout.ops.spec import TRITON_PLATFORMS, Choice, Impl


def _check(platform):
    return platform.triton_usable()


# op name -> "module:function" of its Triton implementation (modules under turnout/ops/triton/)
KERNELS: dict[str, str] = {
    "rms_norm": "norm:rms_norm",
    "fused_add_rms_norm": "norm:fused_add_rms_norm",
    "rotary_embedding": "rotary:rotary_embedding",
    "qk_norm_rotary": "rotary:qk_norm_rotary",
    "qk_norm_rotary_cache": "rotary:qk_norm_rotary_cache",
    "silu_and_mul": "activation:silu_and_mul",
    "gelu_tanh_and_mul": "activation:gelu_tanh_and_mul",
    "clamped_swiglu": "activation:clamped_swiglu",
    "reshape_and_cache": "cache:reshape_and_cache",
    "copy_blocks": "cache:copy_blocks",
    "swap_blocks": "cache:swap_blocks",
    "swap_layer": "swap:swap_layer",
    "swap_layer_async": "swap:swap_layer_async",
    "paged_attention": "attention:paged_attention",
    "rotary_paged_attention": "attention:rotary_paged_attention",
    "sample": "sampling:sample",
    "moe_experts": "moe:moe_experts",
    "select_experts": "routing:select_experts",
    "small_m_linear": "linear:small_m_linear",
    "add_rms_norm_linear": "linear:add_rms_norm_linear",
    "apply_token_bitmask": "bitmask:apply_token_bitmask",
    "quantize_fp8": "fp8:quantize_fp8",
    "scaled_mm": "fp8:scaled_mm",
    "block_scaled_mm": "fp8:block_scaled_mm",
    "fp8_linear": "fp8:fp8_linear",
    "moe_experts_fp8": "moe_fp8:moe_experts_fp8",
    "mla_reshape_and_cache": "mla:mla_reshape_and_cache",
    "mla_paged_attention": "mla:mla_paged_attention",
    "mla_gather_cache": "mla_prefill:mla_gather_cache",
    "varlen_attention": "mla_prefill:varlen_attention",
    "moe_experts_biased": "moe_biased:moe_experts_biased",
    "w4a16_linear": "w4a16:w4a16_linear",
    "moe_experts_w4a16": "moe_w4a16:moe_experts_w4a16",
}


# op -> its claim that a model's decode path should use it (Impl.pays, read by the fusion plan): the one-row
# projection and rope-in-attention always (measured on the H200, docs/benchmarks.md); the pre-norm fused into
# a projection only for the shapes where linear.norm_fusion_pays says the measurements favour it.
PAYS: dict[str, bool | str] = {
    "small_m_linear": True,
    "add_rms_norm_linear": "turnout.ops.triton.linear:norm_fusion_pays",
    "rotary_paged_attention": True,
    "fp8_linear": True,  # the one-row kernel streams the fp8 weight: decode rows skip activation quantisation
}

# op -> the function that binds its tile overrides when the op table is resolved (turnout/ops/triton/_tuning.py)
TUNES: dict[str, str] = {
    "small_m_linear": "turnout.ops.triton._tuning:small_m_tiles",
    "add_rms_norm_linear": "turnout.ops.triton._tuning:small_m_tiles",
    "fp8_linear": "turnout.ops.triton._tuning:small_m_tiles",
    "moe_experts": "turnout.ops.triton.moe_decode_config:tuned",
    "moe_experts_biased": "turnout.ops.triton.moe_decode_config:tuned",
}

# ops whose kernels need e4m3fn fp8 units besides Triton (turnout/ops/fp8_platform.py: sm89+ on CUDA)
FP8_OPS = ("quantize_fp8", "scaled_mm", "block_scaled_mm", "fp8_linear", "moe_experts_fp8")


def _fp8_check(platform):
    ok, why = platform.triton_usable()
    if not ok:
        return ok, why
    from turnout.ops.fp8_platform import check

    return check(platform)


def fp8_kv_check(platform):
    """The fp8 KV cache (every op of kv_cache.FP8_KV_OPS has it here): Triton converts to and from e4m3fn only
    on targets with fp8 units (sm89+), so the fp8 GEMMs' check."""
    return _fp8_check(platform)


def _attn_note() -> str:
    from turnout import envs

    n = envs.get().attn_decode.get("num_splits")
    return f"TURNOUT_ATTN_DECODE sets num_splits={n} at decode" if n is not None else ""


def _moe_note() -> str:
    from turnout import envs

    if envs.get().moe_decode_config.get("one_token") == 0:
        return "TURNOUT_MOE_DECODE_CONFIG one_token=0: the per-slot down kernel at T = 1 too"
    return ""


_NUM_SPLITS = Choice(
    "num_splits", integer=True, maximum=64, note=_attn_note,
    doc="auto: at decode, split each context over several programs (flash-decoding) while batch x KV-head "
        "programs are fewer than the SMs, up to 64 splits and one per 64-token KV tile; prefill never splits. "
        "n: n splits at every decode step (1: never split)")

# op -> the decisions its Triton implementation makes inside itself (Choice): reported by `turnout ops`,
# fixed by `<op>.<choice>=<value>` in TURNOUT_OPS / ops_policy. The defaults are the measured ones.
_MOE_DOC = ("auto: the one-token kernel at T = 1, the decode kernels (no sort) while T*k <= max(128, 4*E), the "
            "sorted grouped GEMM beyond. grouped / decode: that path at every T (decode with its per-slot down "
            "kernel and slot sum, never the one-token kernel)")
CHOICES: dict[str, tuple[Choice, ...]] = {
    "moe_experts": (Choice("kernel", values=("grouped", "decode"), note=_moe_note, doc=_MOE_DOC),),
    "moe_experts_fp8": (Choice("kernel", values=("grouped", "decode"), doc=_MOE_DOC),),
    # the biased / clamped-SwiGLU variant: the sort-free decode kernels and the grouped GEMM (no one-token kernel)
    "moe_experts_biased": (Choice("kernel", values=("grouped", "decode"), doc=(
        "auto: the decode kernels (no sort) while T*k <= max(128, 4*E), the sorted grouped GEMM beyond (no "
        "one-token kernel: its down kernel has no bias). grouped / decode: that path at every T")),),
    "paged_attention": (_NUM_SPLITS,),
    "rotary_paged_attention": (_NUM_SPLITS,),
    "mla_paged_attention": (Choice(
        "num_splits", integer=True, maximum=64,
        doc="auto: at decode, split each context over several programs while token x head-tile programs are "
            "fewer than twice the SMs, at most one split per 4 KV tiles; prefill never splits. n: n splits"),),
}


# ops whose target is a factory that binds its launch tuning once, when the op table is resolved
# (turnout/ops/triton/attention.py: with_decode_tuning), never at launch
FACTORIES: dict[str, str] = {
    "paged_attention": "attention:paged_attention_tuned",
    "rotary_paged_attention": "attention:rotary_paged_attention_tuned",
}


def register(registry) -> None:
    for op, target in KERNELS.items():
        if op not in registry.ops:  # an op whose declaration is not loaded
            continue
        registry.add_impl(Impl(op=op, id="triton.default", target=f"turnout.ops.triton.{FACTORIES.get(op, target)}",
                               factory=op in FACTORIES, platforms=(TRITON_PLATFORMS,), priority=0,
                               check=_fp8_check if op in FP8_OPS else _check, choices=CHOICES.get(op, ()),
                               pays=PAYS.get(op), tunes=TUNES.get(op),
                               kv_fp8=fp8_kv_check if op in FP8_KV_OPS else False))
