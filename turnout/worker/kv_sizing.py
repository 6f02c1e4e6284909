"""How big the paged KV cache is: the layers' specs (turnout/kv/spec.py), the storage dtype, the block count and
the tensors themselves (the model runner's start-up, its wake-up and the host tier's; a module of its own so the
runner keeps to the step)."""

from __future__ import annotations

import logging
import math

import torch

from turnout.kv.spec import CacheLayout
from turnout.layers.attention import AttentionMetadata
from turnout.worker.concurrency import profile_rows

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


def kv_geometry(hf_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the attention layers."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return hf_config.num_hidden_layers, kv_heads, head_dim


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def model_cache_layout(model, cache_dtype: torch.dtype) -> CacheLayout:
    """The specs the model's layers declare, one per cache-holding layer in the order the model takes its
    caches: the model's ``kv_specs(dtype name)`` where it has one, else every module's ``kv_spec`` in module
    order (one attention layer per decoder layer)."""
    name = dtype_name(cache_dtype)
    if callable(getattr(model, "kv_specs", None)):
        return CacheLayout(tuple(model.kv_specs(name)))
    return CacheLayout(tuple(m.kv_spec(name) for m in model.modules() if callable(getattr(m, "kv_spec", None))))


def allocate_caches(layout: CacheLayout, num_blocks: int, block_size: int, num_slots: int, device,
                    pin_memory: bool = False, zero: bool = True, shared: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """One tuple of tensors per layer, as its spec says: ``[num_blocks, block_size, *shape]`` for each of a token
    layer's shapes ((k, v) for attention, one latent tensor), ``[num_slots, *shape]`` for a state layer's.
    ``shared``: layers of several table groups share their owner's tensors (``layout.cache_owner``,
    kv/spec.py: table groups), as the runner's caches do, whose steps give each group its own tables; off, every layer
    has its own (a forward with one table for every layer, as a standalone check builds)."""
    make = torch.zeros if zero else torch.empty
    kw = {"pin_memory": True} if pin_memory else {}
    out = []
    owner = layout.cache_owner if shared else range(len(layout.specs))  # layer j of every group shares tensors
    for i, spec in enumerate(layout.specs):
        if owner[i] != i:
            out.append(out[owner[i]])
        elif spec.per_token:
            dtype = getattr(torch, spec.dtype)
            out.append(tuple(make((num_blocks, block_size, *shape), dtype=dtype, device=device, **kw)
                             for shape in spec.token_shapes))
        else:
            out.append(tuple(make((num_slots, *shape), dtype=getattr(torch, d), device=device, **kw)
                             for shape, d in zip(spec.shapes, spec.dtypes)))
    return out


def block_caches(caches, layout: CacheLayout) -> list[list[torch.Tensor]]:
    """Per layer, the tensors a block id indexes (none for a state layer, nor for a layer that shares its owner's
    tensors, kv/spec.py: table groups: the owner, first in model order, moves them): what block copies and swaps move."""
    owner = layout.cache_owner
    return [list(c) if spec.per_token and owner[i] == i else [] for i, (c, spec) in enumerate(zip(caches, layout.specs))]


def unique_block_tensors(caches) -> list[torch.Tensor]:
    """Every cache tensor once (layers of several table groups share them): what a copy-on-write copies."""
    return list({id(c): c for kv in caches for c in kv}.values())


def state_caches(caches, layout: CacheLayout) -> list[list[torch.Tensor]]:
    """Per layer, the tensors a state slot indexes (none for a token layer)."""
    return [[] if spec.per_token else list(c) for c, spec in zip(caches, layout.specs)]


def cache_bytes(caches) -> int:
    return sum(t.numel() * t.element_size() for t in unique_block_tensors(caches))


def kv_dtype(runner) -> torch.dtype:
    """The cache's storage dtype (turnout/ops/kv_cache.py): the model's, or float8_e4m3fn (bytes per token halve)."""
    from turnout.ops.kv_cache import cache_torch_dtype, check_fp8_storage

    dtype = cache_torch_dtype(runner.config.kv_cache_dtype, runner.dtype)
    if dtype != runner.dtype:
        check_fp8_storage(runner.device, runner.platform.name)
    return dtype


def plan_kv_blocks(runner) -> int:
    """How many KV blocks the cache gets: the configured bytes, 1 GiB on CPU, or what a GPU has left after profiling."""
    if runner.config.kv_cache_memory is not None:
        budget = runner.config.kv_cache_memory
    elif not runner.platform.is_gpu:
        budget = CPU_DEFAULT_KV_BYTES
    else:
        budget = profile_gpu_budget(runner)
    budget -= runner.num_state_slots * runner.cache_layout.state_bytes  # per-request states come first
    blocks = int(budget // runner.block_bytes)
    if blocks < 2:
        raise ValueError(f"kv_cache_memory: {budget} bytes hold fewer than 2 KV blocks of "
                         f"{runner.block_bytes} bytes; give more memory")
    return blocks


def profile_gpu_budget(runner) -> int:
    """Run the largest batch once with a scratch cache; the KV budget is what remains of
    total * gpu_memory_utilization after that peak and after memory used outside torch."""
    dev = runner.device
    n = runner.config.max_num_batched_tokens
    scratch_blocks = math.ceil(n / runner.block_size) + 1
    scratch = allocate_caches(runner.cache_layout, scratch_blocks, runner.block_size, 1, dev, zero=False,
                              shared=True)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    ids = torch.zeros(n, dtype=torch.long, device=dev)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.long, device=dev),
        block_tables=torch.arange(scratch_blocks, dtype=torch.int32, device=dev)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        max_query_len=n, max_seq_len=n)  # no host lengths: latent attention runs absorbed, its larger peak at n keys
    with torch.inference_mode():
        hidden = runner.model(ids, torch.arange(n, device=dev), scratch, meta)
        runner.model.compute_logits(hidden[-profile_rows(runner.config):])
    torch.cuda.synchronize(dev)
    scratch_bytes = cache_bytes(scratch)
    peak = torch.cuda.max_memory_allocated(dev) - scratch_bytes
    del scratch, hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    outside_torch = total - free - torch.cuda.memory_reserved(dev)
    budget = int(total * runner.config.gpu_memory_utilization - peak - outside_torch)
    logger.info("memory profile: total %.1f GiB, peak activations+weights %.2f GiB, outside torch %.2f GiB",
                total / 2**30, peak / 2**30, outside_torch / 2**30)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={runner.config.gpu_memory_utilization}: no memory left for the "
                         f"KV cache (peak {peak / 2**30:.2f} GiB of {total / 2**30:.1f} GiB)")
    return budget
