"""vendor.cpu: CPU paths through torch's own optimised kernels (SDPA's flash kernel for CPU, fused
rms_norm, index_copy_, argmax), fewer temporaries than the reference.

Only the platform ``cpu``; nothing here is imported until probed.

vendor.cpu_native: kernels of turnout's own (csrc/), built on first use with the machine's C++ compiler
(native.py); ranked above vendor.cpu where both serve an op, unavailable with the reason where nothing builds.
"""

from turnout.ops.spec import Impl

OPS = {
    "paged_attention": "attention:paged_attention",
    "sample": "sampling:sample",
    "rms_norm": "norm:rms_norm",
    "fused_add_rms_norm": "norm:fused_add_rms_norm",
    "rotary_embedding": "rotary:rotary_embedding",
    "qk_norm_rotary": "rotary:qk_norm_rotary",
    "qk_norm_rotary_cache": "rotary:qk_norm_rotary_cache",
    "reshape_and_cache": "cache:reshape_and_cache",
    "swap_layer": "swap:swap_layer",
    "w4a16_linear": "w4a16:w4a16_linear",
    "moe_experts_w4a16": "moe_w4a16:moe_experts_w4a16",
}


NATIVE_OPS = {
    "w4a16_linear": "native:w4a16_linear_factory",
    "moe_experts_w4a16": "native:moe_experts_w4a16_factory",
}


def register(registry) -> None:
    for op, target in NATIVE_OPS.items():
        if op in registry.ops:
            registry.add_impl(Impl(op=op, id="vendor.cpu_native", target=f"turnout.ops.vendors.cpu.{target}",
                                   platforms=("cpu",), priority=1, factory=True))
    for op, target in OPS.items():
        if op in registry.ops:
            registry.add_impl(Impl(op=op, id="vendor.cpu", target=f"turnout.ops.vendors.cpu.{target}",
                                   platforms=("cpu",), priority=0, kv_fp8=True))  # fp8 KV: every cache op here
