"""verl's rollout config -> turnout's engine options (turnout/config.py), and the shapes verl may ask for
that turnout's rollout does not serve, refused up front with the config field named."""

from __future__ import annotations

from typing import Any

ENGINE_KWARGS_KEY = "turnout"  # rollout.engine_kwargs.turnout: any further EngineConfig field by name


def check_supported(config) -> None:
    """ValueError naming the rollout config field of a layout turnout does not serve."""
    if config.data_parallel_size != 1:
        raise ValueError(f"rollout.data_parallel_size: turnout's rollout is one engine per replica (got "
                         f"{config.data_parallel_size}); run more replicas instead")
    if config.pipeline_model_parallel_size != 1:
        raise ValueError(f"rollout.pipeline_model_parallel_size: pipeline parallelism is not offered by turnout "
                         f"(got {config.pipeline_model_parallel_size})")
    if config.expert_parallel_size > 1:
        raise ValueError(f"rollout.expert_parallel_size: expert parallelism is not offered by turnout (got "
                         f"{config.expert_parallel_size}); experts are split by tensor_model_parallel_size")
    disagg = getattr(config, "disaggregation", None)
    if disagg is not None and getattr(disagg, "enabled", False):
        raise ValueError("rollout.disaggregation.enabled: prefill/decode disaggregation is not offered by turnout")
    mode = getattr(config, "logprobs_mode", "processed_logprobs")
    if mode not in (None, "processed_logprobs"):
        raise ValueError(f"rollout.logprobs_mode: turnout returns the sampled tokens' logprobs after temperature "
                         f"('processed_logprobs'; top-k / top-p are not applied to them), got {mode!r}")
    ckpt = getattr(config, "checkpoint_engine", None)
    if getattr(ckpt, "backend", None) == "delta_sharded":
        raise ValueError("rollout.checkpoint_engine.backend: delta_sharded sends vLLM's weight patches; use "
                         "naive (colocated) with the turnout rollout")


def engine_options(config, replica_rank: int, devices: str) -> dict[str, Any]:
    """The LLM(...) options of one replica's engine. ``devices``: the accelerators verl gave the replica's
    node ("" on a host without any: the engine runs on the CPU)."""
    opts: dict[str, Any] = {
        "dtype": config.dtype,
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enforce_eager": config.enforce_eager,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "tensor_parallel_size": config.tensor_model_parallel_size,
        "seed": replica_rank + config.seed,
    }
    if getattr(config, "full_determinism", False):
        opts["batch_invariant"] = True  # a request's tokens whatever else is batched (vLLM's batch-invariant mode)
    if config.quantization is not None:
        opts["quantization"] = config.quantization
    if not devices:
        opts["device"] = "cpu"
    extra = (config.engine_kwargs or {}).get(ENGINE_KWARGS_KEY) or {}
    opts.update({k: v for k, v in dict(extra).items() if v is not None})
    return {k: v for k, v in opts.items() if v is not None}
