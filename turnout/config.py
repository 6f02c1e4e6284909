"""Engine configuration: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct GGUF)
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"
    max_model_len: int | None = None
    # Sequences decoded at once. None: what the KV cache holds at max_model_len, in [256, 1024]
    # (turnout/worker/concurrency.py), resolved once the cache is sized
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; CPU default 1 GiB
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    seed: int = 0
    ops_policy: str | None = None
    # A request's tokens and logprobs bitwise the same whatever else is batched with it (batch size, chunked
    # prefill split, prefix-cache hit): batch-invariant op implementations only (turnout/ops/batch_invariant.py)
    batch_invariant: bool = False
    enforce_eager: bool = False  # no CUDA graphs
    # The most draft tokens one sequence verifies in a step (engine/drafts.py): decode CUDA graphs are captured
    # for query lengths 1 .. 1 + this (worker/cuda_graphs.py); 0: one-token decode steps only
    num_speculative_tokens: int = 0
    # Launch the next decode step before this one's tokens reach the host, so the host work of a step
    # (scheduling, metadata, detokenising) overlaps the device's work. None: on where the device runs
    # asynchronously to the host (GPUs), off on CPU (where it changes nothing but the order of work).
    async_scheduling: bool | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    # The most one request may cost, in tokens: n x (prompt + max_tokens) plus its logprob entries
    # (n x max_tokens x (1 + logprobs)); a request over it is refused at admission. None: no limit.
    max_tokens_per_request: int | None = None
    # Fair scheduling: while other requests have work, one request runs at most this many of its
    # sequences per step (or as many as the largest other request, if more), round-robin among them, so
    # an n=128 request cannot make everyone's steps slow (engine/scheduler.py). None: no cap.
    fair_share_seqs: int | None = 16
    # Tensor parallelism: the model split over this many ranks (devices) of this machine; the executor
    # (turnout/executor) runs them: uniproc for one rank, mp (a process per rank) for several.
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: uniproc for one rank, mp for several; or ray
    # Several machines (turnout/executor/multinode.py): tensor_parallel_size / nnodes ranks on each; node 0 runs
    # the engine, nodes 1.. `turnout serve --headless`; rank 0's rendezvous store listens on master_addr:port.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    ray_address: str | None = None  # the ray executor's cluster (None: $RAY_ADDRESS, else a local one)
    # Seconds a tensor-parallel collective (and so a step) may wait for a peer rank before the step fails
    # naming the rank that hangs (the TP process group's timeout, and the mp executor's step watchdog).
    distributed_timeout_s: float = 300.0
    # Data parallelism (turnout/engine/dp.py, the server): this many engine replicas, each its own process
    # with tensor_parallel_size ranks; replica r uses devices [r tp, (r + 1) tp). data_parallel_rank is r,
    # set by the DP client for each replica's engine.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # MoE models: the tensor-parallel ranks split the routed experts by expert id (rank r holds experts
    # [r E/W, (r+1) E/W)) instead of each expert's intermediate dim; attention stays TP-sharded.
    enable_expert_parallel: bool = False
    # KV tiers (docs/architecture.md, "KV tiers"). How a sequence gives up its blocks when the cache is full:
    # "recompute" (free them, prefill again later), "swap" (copy them to the host pool, copy them back
    # before it runs again) or "auto" (swap where moving the blocks costs less than recomputing them, from
    # the copy bandwidth and prefill rate measured at start-up; recompute where no swap op can run here).
    preemption_mode: str = "auto"
    swap_space: float = 4.0  # GiB of host memory (pinned on GPUs) for swapped-out blocks; 0: no swapping
    kv_offload_gb: float = 0.0  # GiB of host memory for prefix blocks evicted from the device; 0: no host tier
    # "fp8": quantise an unquantised checkpoint's linear weights at load (per-channel scales, activations per
    # token; turnout/quant). None: as the checkpoint is (an fp8 checkpoint's quantization_config is read anyway).
    quantization: str | None = None
    # The KV cache's storage: "auto" (the model's dtype) or "fp8" (e4m3fn with per-layer k/v scales: half the
    # bytes per token, twice the tokens; turnout/ops/kv_cache.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"{field}: {why}")

        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "bf16", "fp32", "fp16", "float"):
            bad("dtype", f"unknown dtype {self.dtype!r} (auto, float32, float16, bfloat16)")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad("max_model_len", f"must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs is not None and (isinstance(self.max_num_seqs, bool) or not isinstance(
                self.max_num_seqs, int) or self.max_num_seqs < 1):
            bad("max_num_seqs", f"must be an integer >= 1 or None (auto), got {self.max_num_seqs!r}")
        if isinstance(self.num_speculative_tokens, bool) or not isinstance(self.num_speculative_tokens, int) \
                or not 0 <= self.num_speculative_tokens <= 16:
            bad("num_speculative_tokens", f"must be an integer in [0, 16], got {self.num_speculative_tokens!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            bad("kv_cache_dtype", f"unknown KV cache dtype {self.kv_cache_dtype!r} (auto, fp8)")
        if self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            bad("block_size", f"must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            bad("kv_cache_memory", f"must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_tokens_per_request is not None and (not isinstance(self.max_tokens_per_request, int)
                                                        or self.max_tokens_per_request < 1):
            bad("max_tokens_per_request", f"must be a positive integer or None, got {self.max_tokens_per_request!r}")
        if self.fair_share_seqs is not None and (not isinstance(self.fair_share_seqs, int) or self.fair_share_seqs < 1):
            bad("fair_share_seqs", f"must be a positive integer or None, got {self.fair_share_seqs!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            bad("tensor_parallel_size", f"must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend not in (None, "uniproc", "mp", "ray"):
            bad("distributed_executor_backend",
                f"unknown backend {self.distributed_executor_backend!r} (uniproc, mp, ray)")
        if not isinstance(self.nnodes, int) or self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            bad("nnodes", f"must be a positive integer dividing tensor_parallel_size "
                f"{self.tensor_parallel_size}, got {self.nnodes!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            bad("node_rank", f"must be in [0, {self.nnodes}) (nnodes), got {self.node_rank!r}")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            bad("master_port", f"must be a TCP port in [1, 65535], got {self.master_port!r}")
        if self.nnodes > 1 and self.distributed_executor_backend == "ray":
            bad("nnodes", "the ray backend places the ranks on the cluster's nodes itself: leave nnodes at 1")
        if self.distributed_executor_backend == "uniproc" and self.tensor_parallel_size != 1:
            bad("distributed_executor_backend", f"uniproc runs one rank, but tensor_parallel_size is "
                f"{self.tensor_parallel_size}; use mp")
        t = self.distributed_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            bad("distributed_timeout_s", f"must be a finite number of seconds > 0, got {t!r}")
        if not isinstance(self.data_parallel_size, int) or isinstance(self.data_parallel_size, bool) \
                or self.data_parallel_size < 1:
            bad("data_parallel_size", f"must be a positive integer, got {self.data_parallel_size!r}")
        if not isinstance(self.data_parallel_rank, int) or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            bad("data_parallel_rank", f"must be in [0, {self.data_parallel_size}) (data_parallel_size), "
                f"got {self.data_parallel_rank!r}")
        if self.data_parallel_size > 1 and self.nnodes > 1:
            bad("data_parallel_size", "data parallelism runs its replicas on this machine: not with nnodes > 1")
        if not isinstance(self.enable_expert_parallel, bool):
            bad("enable_expert_parallel", f"must be True or False, got {self.enable_expert_parallel!r}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            bad("preemption_mode", f"unknown mode {self.preemption_mode!r} (recompute, swap, auto)")
        for name in ("swap_space", "kv_offload_gb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                bad(name, f"must be a finite number of GiB >= 0, got {v!r}")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            bad("swap_space", "preemption_mode='swap' needs swap_space > 0 GiB")
        if self.quantization is not None:
            from turnout.quant.config import METHODS

            if self.quantization not in METHODS:
                bad("quantization", f"unknown method {self.quantization!r} ({', '.join(METHODS)})")
        if self.batch_invariant and self.tensor_parallel_size != 1:
            bad("batch_invariant", "not with tensor_parallel_size > 1 (an all-reduce's summation order depends on "
                "the message size, so on the batch)")
        if self.batch_invariant and getattr(self, "quantization", None) is not None:
            bad("batch_invariant", "not with quantization (the quantised GEMMs have no batch-invariant kernel)")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            bad("load_format", f"unknown load format {self.load_format!r} (auto, safetensors, gguf, dummy)")
