"""Engine configuration: one frozen dataclass, validated once.

Each field carries its documentation in its metadata (``option(...)``): the help text, and where the
command line differs from the field, its flag, a short alias, choices or a metavar. ``LLM(**options)``
(turnout/engine/llm.py) and the engine flags of `turnout serve / generate / bench`
(turnout/entrypoints/engine_args.py) are made from these fields, so a new field is a new keyword argument
and a new flag with its --help text, and nothing else needs to list it. ``engine_config(**options)`` takes
them by name: a mistyped name is refused with the field it was probably meant to be, and vLLM's options that
change nothing in turnout are accepted with a note, so a vLLM command line or script runs as it is.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass, field

logger = logging.getLogger("turnout.config")


def option(default, help: str, *, flag: str | None = None, short: str | None = None, choices=None,
           metavar: str | None = None, group: str = "engine", cli: bool = True, none_as=None):
    """A field with its documentation. ``flag``: the long flag when it is not --field-name; ``short``: an alias
    (-tp); ``group``: where serve's --help shows it (model or engine); ``cli=False``: no flag (set by
    turnout itself); ``none_as``: the flag value that stands for None (0 for "no cap")."""
    return field(default=default, metadata={"help": help, "flag": flag, "short": short, "choices": choices,
                                            "metavar": metavar, "group": group, "cli": cli, "none_as": none_as})


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = option(
        None, "HF model id, local directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
        group="model")
    dtype: str = option("auto", "the weights' and activations' dtype: auto (the checkpoint's), float32, float16 "
                        "or bfloat16", group="model")
    device: str = option("auto", "auto, cpu, cuda, ...")
    max_model_len: int | None = option(
        None, "context length; longer requests are refused (default: the model's)")
    max_num_seqs: int | None = option(
        None, "sequences generated at once (default: as many as the KV cache holds at --max-model-len, 256 to "
        "1024; turnout/engine/concurrency.py)")
    max_num_batched_tokens: int = option(
        2048, "tokens in one step: a longer prompt is prefilled in chunks of this many")
    block_size: int = option(16, "tokens in one KV-cache block (a power of two)")
    kv_cache_memory: int | None = option(None, "KV-cache bytes (default: what the memory utilization leaves on "
                                         "a GPU, 1 GiB on CPU)")
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory for weights + KV cache")
    enable_prefix_caching: bool = option(True, "reuse the KV cache of shared prompt prefixes")
    load_format: str = option("auto", "how to read the weights", choices=("auto", "safetensors", "gguf", "dummy"),
                              group="model")
    seed: int = option(0, "seed of requests that give none", group="model")
    ops_policy: str | None = option(None, "op dispatch policy (as TURNOUT_OPS; docs/ops.md)")
    batch_invariant: bool = option(
        False, "a request's tokens and logprobs bitwise the same whatever else is batched with it (batch size, "
        "chunked prefill, prefix-cache hits): batch-invariant kernels only (turnout/ops/batch_invariant.py); "
        "slower")
    enforce_eager: bool = option(False, "no CUDA graphs")
    num_speculative_tokens: int = option(
        0, "the most draft tokens one sequence verifies in a step (turnout/engine/drafts.py): decode CUDA graphs "
        "are captured for query lengths 1 .. 1 + this (0: one-token decode steps only)")
    # None: on where the device runs asynchronously to the host (GPUs); on CPU it would change nothing but the
    # order of work.
    async_scheduling: bool | None = option(
        None, "launch the next decode step before the last one's tokens are read back, so the host's work of "
        "a step overlaps the device's (default: on for GPUs, off on CPU)")
    tokenizer: str | None = option(None, "a tokenizer other than the model's", group="model")
    served_model_name: str | None = option(None, "the name the model answers to in the API", group="model")
    max_tokens_per_request: int | None = option(
        None, "the most one request may cost: n x (prompt + max_tokens) plus its logprob entries (n x "
        "max_tokens x (1 + logprobs)); more is refused at admission (default: no limit)")
    fair_share_seqs: int | None = option(
        16, "while others wait, one request runs at most this many of its sequences a step (or as many as "
        "the largest other request), round-robin, so an n=128 request cannot slow everyone's steps (0: no cap)",
        none_as=0)
    tensor_parallel_size: int = option(
        1, "split the model over this many ranks (devices) of this machine (a process per rank)", short="-tp")
    distributed_executor_backend: str | None = option(
        None, "what runs the ranks: uniproc (one rank, in-process), mp (a process per rank on this machine) or "
        "ray (Ray actors; pip install 'turnout[ray]'); default: uniproc for one rank, mp for several",
        choices=("uniproc", "mp", "ray"))
    # Several machines (turnout/executor/multinode.py): tensor_parallel_size / nnodes ranks on each.
    nnodes: int = option(1, "machines the -tp ranks span (-tp / nnodes ranks each); node 0 runs the engine, the "
                         "others `turnout serve ... --headless`")
    node_rank: int = option(0, "this machine's place among the --nnodes (0: the engine)")
    master_addr: str = option(
        "127.0.0.1", "node 0's address on the cluster network: its rendezvous store listens there, and only there")
    master_port: int = option(29500, "the rendezvous port on --master-addr")
    ray_address: str | None = option(
        None, "the Ray cluster of --distributed-executor-backend ray (default: $RAY_ADDRESS, else the cluster "
        "`ray start` left on this machine, else a local Ray instance)")
    distributed_timeout_s: float = option(
        300.0, "how long a tensor-parallel step may wait for a peer rank before it fails naming the rank that "
        "hangs (the process group's collective timeout and the step watchdog)",
        flag="--distributed-timeout", metavar="SECONDS")
    # Data parallelism (turnout/engine/dp.py, the server): replica r uses devices [r tp, (r + 1) tp).
    data_parallel_size: int = option(
        1, "engine replicas behind this server, each its own process with -tp ranks (replica r on devices "
        "[r tp, (r + 1) tp)); requests go to the least loaded replica", short="-dp")
    data_parallel_rank: int = option(0, "this replica's index, set by the data-parallel client for each "
                                     "replica's engine", cli=False)
    enable_expert_parallel: bool = option(
        False, "MoE models: the tensor-parallel ranks split the routed experts by expert id (rank r holds "
        "experts [r E/W, (r+1) E/W)), not by intermediate dim; attention stays TP-sharded")
    # KV tiers (docs/architecture.md, "KV tiers"); "auto" measures the copy bandwidth and prefill rate at
    # start-up, and recomputes where no swap op can run here.
    preemption_mode: str = option(
        "auto", "when the KV cache is full: recompute, swap to host memory, or auto (the cheaper, measured)",
        choices=("recompute", "swap", "auto"))
    swap_space: float = option(4.0, "GiB of host memory (pinned on GPUs) for swapped-out KV blocks; 0: no "
                               "swapping")
    kv_offload_gb: float = option(0.0, "GiB of host memory for prefix blocks evicted from the device (0: no "
                                  "host tier)")
    quantization: str | None = option(
        None, "fp8: quantise the linear weights of an unquantised checkpoint at load (per-channel scales, "
        "activations per token; turnout/quant); an fp8 checkpoint is read as it is without it. awq, gptq, "
        "compressed-tensors: the checkpoint's own 4-bit method, checked against its quantization_config (read "
        "without the flag too). gguf: keep a GGUF file's Q4_0 / Q4_1 projections in 4 bits instead of float",
        choices=("fp8", "awq", "gptq", "compressed-tensors", "gguf"))
    kv_cache_dtype: str = option(
        "auto", "the KV cache's storage: auto (the model's dtype) or fp8 (e4m3 with per-layer k/v scales, 1.0 "
        "or the checkpoint's: half the bytes per token, twice the tokens held; turnout/ops/kv_cache.py)",
        choices=("auto", "fp8"))
    # Which code runs the model (turnout/models/registry.py resolve_model_class): turnout's own class, or
    # transformers' modeling code with turnout's paged attention and kernels (turnout/models/transformers_backend).
    model_impl: str = option(
        "auto", "which implementation runs the model: native (turnout's own class), transformers (transformers' "
        "modeling code with turnout's paged attention, KV cache and kernels) or auto (native where turnout has "
        "the architecture, else transformers where its class supports the attention interface); `turnout "
        "models` lists which applies to each architecture", choices=("auto", "native", "transformers"),
        group="model")
    # The first N decoder layers only (the model's final norm and head kept): a layer-truncated draft's engine
    # (speculative_config's num_draft_layers); set by turnout itself
    num_hidden_layers: int | None = option(None, "the model's first N decoder layers only (a self-draft)",
                                           group="model", cli=False)
    # Speculative decoding (turnout/speculative_config.py, turnout/engine/speculative.py): vLLM's dict, or its
    # JSON text on the command line; it sets num_speculative_tokens (the graphs' query lengths) to its k.
    speculative_config: str | dict | None = option(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
        "\"prompt_lookup_min\": a, \"prompt_lookup_max\": b} or {\"model\": DRAFT, \"num_speculative_tokens\": k} "
        "(a draft model with the target's tokenizer), {\"method\": \"mtp\", \"num_speculative_tokens\": k} (the "
        "checkpoint's MTP layer) or {\"method\": \"eagle3\", \"model\": HEAD, \"num_speculative_tokens\": k} (an "
        "EAGLE-3 head); greedy and seeded output are those without it",
        metavar="JSON")

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"{field}: {why}")

        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "bf16", "fp32", "fp16", "float"):
            bad("dtype", f"unknown dtype {self.dtype!r} (auto, float32, float16, bfloat16)")
        if self.num_hidden_layers is not None and (isinstance(self.num_hidden_layers, bool) or not isinstance(
                self.num_hidden_layers, int) or self.num_hidden_layers < 1):
            bad("num_hidden_layers", f"must be an integer >= 1, got {self.num_hidden_layers!r}")
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
        if self.model_impl not in ("auto", "native", "transformers"):
            bad("model_impl", f"unknown implementation {self.model_impl!r} (auto, native, transformers)")
        from turnout.speculative_config import parse_speculative_config

        spec = parse_speculative_config(self.speculative_config)  # ValueError naming speculative_config.<field>
        object.__setattr__(self, "speculative", spec)  # the parsed settings (not a field: the field keeps the input)
        if spec is not None:
            if self.num_speculative_tokens not in (0, spec.num_speculative_tokens):
                bad("num_speculative_tokens", f"{self.num_speculative_tokens} differs from speculative_config's "
                    f"{spec.num_speculative_tokens}: give it in one place")
            object.__setattr__(self, "num_speculative_tokens", spec.num_speculative_tokens)


FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))


@dataclass(frozen=True)
class VllmNoOp:
    """A vLLM option turnout accepts without effect. ``accepts``: the values that mean nothing here (a flag's:
    True); another value is refused with ``refusal``, because it would ask for something turnout does not do."""

    why: str
    accepts: tuple = (True,)
    refusal: str = ""
    metavar: str | None = None  # an option that takes a value (not a flag)
    server: bool = False  # a flag of `vllm serve` only (not of vLLM's LLM / EngineArgs)


VLLM_NOOPS = {
    "disable_log_requests": VllmNoOp("turnout logs no line per request", server=True),
    "disable_log_stats": VllmNoOp("turnout logs no periodic statistics (they are on /metrics)"),
    "disable_uvicorn_access_log": VllmNoOp("turnout's server writes no access log", server=True),
    "disable_frontend_multiprocessing": VllmNoOp("turnout's server runs no front-end process of its own",
                                                 server=True),
    "enable_chunked_prefill": VllmNoOp(
        "turnout always prefills a long prompt in chunks of max_num_batched_tokens",
        refusal="turnout has no unchunked prefill: a prompt longer than max_num_batched_tokens is always chunked"),
    "generation_config": VllmNoOp(
        "turnout's request defaults are its own (vLLM's 'vllm' mode): the model's generation_config.json "
        "sets no default temperature, top_p or top_k (its eos_token_id list is read: those tokens end a sequence, "
        "as in vLLM)", accepts=("auto", "vllm"), metavar="{auto,vllm}",
        refusal="a folder's generation_config.json is not applied by turnout (its defaults are vLLM's own, "
        "as with 'vllm'); give 'auto' or 'vllm', or leave it out, and set sampling parameters per request"),
}


def unknown_option(name: str, known, spell=lambda n: n) -> ValueError:
    """The error for an option nobody knows, naming the nearest known one. ``spell`` writes a name as the
    caller's user typed it (a field for LLM, a --flag on a command line)."""
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {spell(close[0])!r}?" if close else ""
    return ValueError(f"unknown option {spell(name)!r}{hint}")


def note_vllm_noop(name: str, value, spell=lambda n: n) -> None:
    """Log that vLLM option ``name`` changes nothing here, or refuse a value that would ask for something."""
    noop = VLLM_NOOPS[name]
    if value in noop.accepts or (value is False and not noop.refusal):  # turning a no-op off: no-op too
        logger.info("%s=%s: accepted for vLLM compatibility, no effect: %s", spell(name), value, noop.why)
        return
    raise ValueError(f"{spell(name)}: {value!r} is not supported: {noop.refusal or noop.why}")


def engine_config(**options) -> EngineConfig:
    """EngineConfig from keyword options: unknown names are an error naming the closest field; vLLM's no-op
    options are noted and dropped."""
    for name in list(options):
        if name in VLLM_NOOPS and not VLLM_NOOPS[name].server:
            note_vllm_noop(name, options.pop(name))
        elif name not in FIELDS:
            raise unknown_option(name, FIELDS)
    return EngineConfig(**options)
