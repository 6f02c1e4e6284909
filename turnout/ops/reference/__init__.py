"""PyTorch reference implementations: the meaning of every op, and their declarations."""

from turnout.ops.spec import OpSpec


def all_specs() -> list[OpSpec]:
    from turnout.ops.reference import (
        activation,
        attention,
        bitmask,
        cache,
        collectives,
        fp8,
        linear,
        mla,
        mla_prefill,
        moe,
        moe_biased,
        moe_fp8,
        moe_w4a16,
        norm,
        rotary,
        routing,
        sampling,
        swap,
        w4a16,
    )

    return [norm.RMS_NORM, norm.FUSED_ADD_RMS_NORM, rotary.ROTARY_EMBEDDING, rotary.QK_NORM_ROTARY, rotary.QK_NORM_ROTARY_CACHE,
            activation.SILU_AND_MUL, activation.GELU_TANH_AND_MUL,
            activation.CLAMPED_SWIGLU,
            cache.RESHAPE_AND_CACHE, cache.COPY_BLOCKS, cache.SWAP_BLOCKS, attention.PAGED_ATTENTION,
            sampling.SAMPLE, moe.MOE_EXPERTS, routing.SELECT_EXPERTS, linear.SMALL_M_LINEAR,
            linear.ADD_RMS_NORM_LINEAR, attention.ROTARY_PAGED_ATTENTION,
            bitmask.APPLY_TOKEN_BITMASK, swap.SWAP_LAYER, swap.SWAP_LAYER_ASYNC,
            collectives.ALL_REDUCE, collectives.ALL_GATHER, collectives.REDUCE_SCATTER, collectives.ALL_TO_ALL,
            fp8.QUANTIZE_FP8, fp8.SCALED_MM, fp8.BLOCK_SCALED_MM, fp8.FP8_LINEAR, moe_fp8.MOE_EXPERTS_FP8,
            mla.MLA_RESHAPE_AND_CACHE, mla.MLA_PAGED_ATTENTION,
            mla_prefill.MLA_GATHER_CACHE, mla_prefill.VARLEN_ATTENTION,
            moe_biased.MOE_EXPERTS_BIASED, w4a16.W4A16_LINEAR,
            moe_w4a16.MOE_EXPERTS_W4A16]
