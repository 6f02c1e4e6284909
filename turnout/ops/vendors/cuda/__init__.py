"""vendor.cuda: native CUDA/HIP kernels, when a library that ships them is installed.

Today that is vLLM's compiled extension (``vllm._C``), whose ops live in the lazy namespaces
``torch.ops._C`` and ``torch.ops._C_cache_ops``, and torch's own grouped GEMM for ``moe_experts``
(``moe.py``, ranked below the Triton kernel), and ``torch._scaled_mm`` for ``scaled_mm`` (``fp8.py``). The
loaders in ``vllm_ops`` fetch each op for real, so a wheel built without compiled ops (whose namespaces exist all the
same) shows up as "unavailable: ..." here, and the op falls back.
This module only declares; nothing is imported until an implementation is probed.
"""

from turnout.ops.spec import Impl

PLATFORMS = ("cuda", "rocm")

# op -> loader in turnout.ops.vendors.cuda.vllm_ops returning the callable with turnout's signature
LOADERS = {
    "rms_norm": "load_rms_norm",
    "fused_add_rms_norm": "load_fused_add_rms_norm",
    "silu_and_mul": "load_silu_and_mul",
    "reshape_and_cache": "load_reshape_and_cache",
}


def register(registry) -> None:
    for op, loader in LOADERS.items():
        if op in registry.ops:
            registry.add_impl(Impl(op=op, id="vendor.cuda", target=f"turnout.ops.vendors.cuda.vllm_ops:{loader}",
                                   factory=True, platforms=PLATFORMS, priority=0))
    for op in ("swap_layer", "swap_layer_async"):  # torch's own async copies (swap.py): no library needed
        # One DMA per run of consecutive blocks, issued from the host: it lost to the Triton kernel that
        # reads pinned host memory in place (one launch a layer) on scattered blocks, so it ranks below it.
        if op in registry.ops:
            registry.add_impl(Impl(op=op, id="vendor.cuda", target=f"turnout.ops.vendors.cuda.swap:{op}",
                                   platforms=PLATFORMS, priority=0, below=("triton",)))
    if "scaled_mm" in registry.ops:  # torch._scaled_mm with row-wise scales (fp8.py), sm90+
        registry.add_impl(Impl(op="scaled_mm", id="vendor.cuda", target="turnout.ops.vendors.cuda.fp8:load",
                               factory=True, platforms=("cuda",)))
    if "moe_experts" in registry.ops:
        # torch's grouped GEMM (moe.py): conformance-tested, but it lost to the Triton paths at every batch
        # size (docs/benchmarks.md, "MoE experts kernel alone"), so it ranks below Triton: the fallback where
        # Triton is missing or denied. TURNOUT_OPS="moe_experts=vendor.cuda|..." puts it first.
        registry.add_impl(Impl(op="moe_experts", id="vendor.cuda", target="turnout.ops.vendors.cuda.moe:load",
                               factory=True, platforms=("cuda",), below=("triton",)))
