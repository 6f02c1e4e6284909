"""Portable Triton kernels. Registered lazily: ``triton`` is imported only when a kernel is probed."""

from turnout.ops.spec import TRITON_PLATFORMS, Impl


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
    "reshape_and_cache": "cache:reshape_and_cache",
    "copy_blocks": "cache:copy_blocks",
    "swap_blocks": "cache:swap_blocks",
    "paged_attention": "attention:paged_attention",
    "rotary_paged_attention": "attention:rotary_paged_attention",
    "sample": "sampling:sample",
    "moe_experts": "moe:moe_experts",
    "select_experts": "routing:select_experts",
    "small_m_linear": "linear:small_m_linear",
    "add_rms_norm_linear": "linear:add_rms_norm_linear",
}


def register(registry) -> None:
    for op, target in KERNELS.items():
        if op not in registry.ops:  # an op whose declaration is not loaded
            continue
        registry.add_impl(Impl(op=op, id="triton.default", target=f"turnout.ops.triton.{target}",
                               platforms=(TRITON_PLATFORMS,), priority=0, check=_check))
