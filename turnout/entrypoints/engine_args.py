"""Engine flags that serve, generate and bench share (one definition, so the three cannot drift)."""

from __future__ import annotations


def add_kv_tier_and_parallel_args(p) -> None:
    """--preemption-mode, --swap-space, --kv-offload-gb, -tp / --tensor-parallel-size, --enable-expert-parallel,
    --batch-invariant, --distributed-executor-backend, --distributed-timeout."""
    p.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"],
                   help="when the KV cache is full: recompute, swap to host memory, or auto (the cheaper, measured)")
    p.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped-out KV blocks")
    p.add_argument("--kv-offload-gb", type=float, default=0.0,
                   help="GiB of host memory for prefix blocks evicted from the device (0: no host tier)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many ranks (devices) of this machine (a process per rank)")
    p.add_argument("--distributed-executor-backend", default=None, choices=["uniproc", "mp", "ray"],
                   help="what runs the ranks: uniproc (one rank, in-process), mp (a process per rank on this "
                        "machine) or ray (Ray actors; pip install 'turnout[ray]'); default: uniproc for one rank, "
                        "mp for several")
    p.add_argument("--distributed-timeout", dest="distributed_timeout_s", type=float, default=300.0,
                   metavar="SECONDS",
                   help="how long a tensor-parallel step may wait for a peer rank before it fails naming the "
                        "rank that hangs (the process group's collective timeout and the step watchdog)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: the tensor-parallel ranks split the experts by expert id, not by intermediate dim")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens and logprobs bitwise the same whatever else is batched with it (batch "
                        "size, chunked prefill, prefix-cache hits): batch-invariant kernels only; slower")


def add_data_parallel_arg(p) -> None:
    """-dp / --data-parallel-size (serve: engine replicas behind one server, turnout/engine/dp.py)."""
    p.add_argument("-dp", "--data-parallel-size", type=int, default=1,
                   help="engine replicas behind this server, each its own process with -tp ranks (replica r on "
                        "devices [r tp, (r + 1) tp)); requests go to the least loaded replica")


def distributed_kwargs(args) -> dict:
    """The engine fields the flags of add_kv_tier_and_parallel_args that are not LLM's own names set
    (EngineConfig / LLM keyword arguments)."""
    return {"distributed_executor_backend": args.distributed_executor_backend,
            "distributed_timeout_s": args.distributed_timeout_s}


def add_quantization_arg(p) -> None:
    """--quantization (turnout/quant), --kv-cache-dtype (turnout/ops/kv_cache.py)."""
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantise the linear weights of an unquantised checkpoint at load (per-channel "
                        "scales, activations per token); an fp8 checkpoint is read as it is without it")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the KV cache's storage: auto (the model's dtype) or fp8 (e4m3 with per-layer k/v scales, 1.0 "
                        "or the checkpoint's: half the bytes per token, twice the tokens held)")


def add_multinode_args(p, headless: bool = False) -> None:
    """--nnodes, --node-rank, --master-addr, --master-port, --ray-address (turnout/executor/multinode.py,
    ray_executor.py); ``headless`` adds serve's --headless (the nodes other than 0)."""
    p.add_argument("--nnodes", type=int, default=1,
                   help="machines the -tp ranks span (-tp / nnodes ranks each); node 0 runs the engine, the "
                        "others `turnout serve ... --headless`")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's place among the --nnodes (0: the engine)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="node 0's address on the cluster network: its rendezvous store listens there, and only there")
    p.add_argument("--master-port", type=int, default=29500, help="the rendezvous port on --master-addr")
    p.add_argument("--ray-address", default=None,
                   help="the Ray cluster of --distributed-executor-backend ray (default: $RAY_ADDRESS, else the "
                        "cluster `ray start` left on this machine, else a local Ray instance)")
    if headless:
        p.add_argument("--headless", action="store_true",
                       help="nodes 1.. of a multi-node engine: run this node's ranks with node 0's engine "
                            "configuration, no HTTP; exits when node 0 goes")


def multinode_kwargs(args) -> dict:
    """The engine fields add_multinode_args sets (EngineConfig / LLM keyword arguments)."""
    return {"nnodes": args.nnodes, "node_rank": args.node_rank, "master_addr": args.master_addr,
            "master_port": args.master_port, "ray_address": args.ray_address}
