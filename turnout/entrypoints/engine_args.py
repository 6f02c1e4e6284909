"""Engine flags that serve, generate and bench share (one definition, so the three cannot drift)."""

from __future__ import annotations


def add_kv_tier_and_parallel_args(p) -> None:
    """--preemption-mode, --swap-space, --kv-offload-gb, -tp / --tensor-parallel-size, --enable-expert-parallel,
    --batch-invariant."""
    p.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"],
                   help="when the KV cache is full: recompute, swap to host memory, or auto (the cheaper, measured)")
    p.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped-out KV blocks")
    p.add_argument("--kv-offload-gb", type=float, default=0.0,
                   help="GiB of host memory for prefix blocks evicted from the device (0: no host tier)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many ranks (devices) of this machine (a process per rank)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: the tensor-parallel ranks split the experts by expert id, not by intermediate dim")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens and logprobs bitwise the same whatever else is batched with it (batch "
                        "size, chunked prefill, prefix-cache hits): batch-invariant kernels only; slower")


def add_quantization_arg(p) -> None:
    """--quantization (turnout/quant)."""
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantise the linear weights of an unquantised checkpoint at load (per-channel "
                        "scales, activations per token); an fp8 checkpoint is read as it is without it")
