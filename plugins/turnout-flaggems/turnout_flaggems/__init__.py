"""FlagGems (PyPI ``flag-gems``, Triton kernels with backends for several vendors) as turnout's vendor family
``vendor.flaggems``.

``register`` runs at start-up in every turnout process that has this package installed, so it only declares:
each implementation's target is a loader in ``turnout_flaggems.loaders`` (``Impl(factory=True)``), which
imports FlagGems when the implementation is probed (library.py: once, with its first error kept as every
implementation's reason) and binds the wrapper to it. The wrappers (norm.py, attention.py, moe.py, fp8.py)
keep turnout's contracts exactly; a call shape FlagGems does not serve goes to the next implementation in the
policy's order (``delegates=True``: the resolution binds it as ``fallback``).

Rank: below turnout's Triton kernels (``below=("triton",)``) until the GPU numbers of
benchmarks/flaggems_ops.py say otherwise; ``python -m turnout_flaggems`` prints the policy that puts FlagGems
first for every op it serves.
"""

from turnout.ops import Impl
from turnout_flaggems import platforms

# op -> (the wrapper's module, the FlagGems functions it calls, whether some call shapes go to the next
# implementation, the capability check); the wrapper is the function of the op's name in that module
OPS = {
    "rms_norm": ("norm", ("rms_norm",), False, platforms.serves),
    "fused_add_rms_norm": ("norm", ("fused_add_rms_norm",), False, platforms.serves),
    "silu_and_mul": ("norm", ("silu_and_mul_out",), False, platforms.serves),
    "rotary_embedding": ("attention", ("apply_rotary_pos_emb",), True, platforms.serves),
    "reshape_and_cache": ("attention", ("reshape_and_cache_flash",), True, platforms.serves),
    "paged_attention": ("attention", ("flash_attn_varlen_func",), True, platforms.serves),
    "select_experts": ("moe", ("topk_softmax", "grouped_topk"), True, platforms.serves),
    "moe_experts": ("moe", ("fused_experts_impl",), True, platforms.serves),
    "moe_experts_fp8": ("moe", ("fused_experts_impl",), True, platforms.fp8),
    "quantize_fp8": ("fp8", ("per_token_group_quant_fp8",), True, platforms.fp8),
    "scaled_mm": ("fp8", ("cutlass_scaled_mm",), True, platforms.sm90),
    "block_scaled_mm": ("fp8", ("w8a8_block_fp8_matmul",), False, platforms.fp8),
}

# Not measured against turnout's Triton kernels yet: ranked after them, before the reference.
BELOW = ("triton",)


def register(registry) -> None:
    for op, (_, _, delegates, check) in OPS.items():
        if op in registry.ops:  # an older turnout without the op: skip it rather than fail the plugin
            registry.add_impl(Impl(op=op, id="vendor.flaggems", target=f"turnout_flaggems.loaders:{op}",
                                   factory=True, platforms=platforms.PLATFORMS, below=BELOW, check=check,
                                   delegates=delegates))


def prefer_policy(exclusive: bool = False) -> str:
    """The TURNOUT_OPS / ops_policy text that tries FlagGems first for every op it serves, then the platform's
    usual order (``prefer`` takes families, and ``below`` keeps this one after triton within any family order,
    so each op is ordered by name). ``exclusive``: also keep turnout's fused decode kernels (pre-norms inside
    the projections, RoPE + cache write inside attention) from taking the decode path past those ops, by
    giving the fused ops to the reference, which makes no claim (turnout/layers/fusion.py)."""
    text = ";".join(f"{op}=vendor.flaggems|vendor|triton|reference" for op in OPS)
    return text + (";add_rms_norm_linear=reference;rotary_paged_attention=reference" if exclusive else "")
