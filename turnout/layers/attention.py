"""Paged attention layer and the per-step metadata it reads.

The metadata is built once per step by the model runner and passed down as an argument (never a
global). The layer writes this step's keys/values into the paged cache, then attends over it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from turnout.distributed.parallel_state import SINGLE, TPGroup


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged KV cache and which cached tokens they see.

    ``T`` new tokens of ``B`` sequences are packed back to back (prefill chunks and decodes mixed).
    """

    slot_mapping: torch.Tensor  # [T] int64, block * block_size + offset per new token; -1 skips
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens per sequence
    query_start_loc: torch.Tensor  # [B + 1] int32, each sequence's slice of the T new tokens
    max_query_len: int  # host ints: kernels size their grids without a device sync
    max_seq_len: int
    # Host copies of seq_lens / query_start_loc where the builder has them (the model runner): a model that plans
    # its step from the lengths (latent attention's decompressed prefill) reads them instead of syncing the device
    seq_lens_host: tuple[int, ...] | None = None
    query_start_loc_host: tuple[int, ...] | None = None
    # The latent-attention model's per-step plan (turnout/layers/mla_prefill.py), made by its forward; None elsewhere
    latent_prefill: object | None = None
    # Several table groups (turnout/kv/spec.py: table groups): (slot_mapping, block_tables) of groups 1.. (the fields
    # above are group 0's) and each layer's group. None with one table: every layer reads the fields above.
    group_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    layer_group: tuple[int, ...] | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def layer_metas(self) -> list[AttentionMetadata] | None:
        """The metadata each layer reads (its table group's slot mapping and block tables); None with one
        table (every layer reads this one)."""
        if self.group_tables is None:
            return None
        groups = [self] + [replace(self, slot_mapping=s, block_tables=t, group_tables=None, layer_group=None)
                           for s, t in self.group_tables]
        return [groups[g] for g in self.layer_group]


def _scale_loader(param: torch.Tensor, tensor: torch.Tensor, shard_id=None) -> None:
    """A checkpoint's per-tensor k_scale / v_scale (a scalar or one element) into its [1] float32 parameter."""
    if tensor.numel() != 1:
        raise ValueError(f"a KV cache scale must have one element (per-tensor), got shape {tuple(tensor.shape)}; "
                         "per-head scales are not supported yet")
    param.data.copy_(tensor.reshape(1).to(param.dtype))


def _kv_scale() -> nn.Parameter:
    """A per-tensor fp8 KV scale, 1.0 unless the checkpoint has one: optional in a checkpoint (no shard ids to
    wait for, turnout/models/weight_map.py), kept at 1.0 by dummy weights, float32 whatever the model's dtype."""
    p = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
    p.shard_ids = ()
    p.weight_loader = _scale_loader
    p.dummy_init = lambda param, gen, std: param.fill_(1.0)
    return p


def _sinks_param(num_heads: int, tp: TPGroup) -> nn.Parameter:
    """Learned per-head sink logits, float32 whatever the model's dtype (they join a float32 softmax). The
    checkpoint holds one per head of the whole model; this rank keeps its own heads' slice."""
    p = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)

    def load(param: torch.Tensor, tensor: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for attention sinks")
        if tensor.dim() != 1 or tensor.shape[0] != num_heads * tp.size:
            raise ValueError(f"attention sinks: checkpoint tensor {tuple(tensor.shape)}, expected "
                             f"({num_heads * tp.size},) (one per query head)")
        param.data.copy_(tensor.narrow(0, tp.rank * num_heads, num_heads).to(param.dtype))

    p.weight_loader = load
    return p


class Attention(nn.Module):
    """Causal GQA attention over a paged KV cache: ``ops.reshape_and_cache`` then ``ops.paged_attention``.

    No weights: the projections live in the model's attention block. With an fp8 KV cache (the op table's
    policy says ``kv_cache=fp8``: turnout/ops/kv_cache.py) it holds ``k_scale`` / ``v_scale``, [1] float32
    parameters (1.0, or a checkpoint's ``self_attn.k_scale`` / ``v_scale``), which every cache op gets:
    ``cache_kwargs``, also passed by the model's fused decode paths.

    The layer's own attention variant (turnout/ops/reference/attention_variants.py): ``sliding_window`` (keys
    within W positions, itself included), ``logit_softcap`` and, with ``sinks=True``, a ``sinks`` parameter of
    this rank's ``num_heads`` float32 logits (the checkpoint's [total heads] sliced by ``tp``). Every attention op
    call gets them through ``attention_kwargs``; a layer without a variant passes none, so its calls are the
    plain ones.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ops, *,
                 sliding_window: int | None = None, logit_softcap: float | None = None, sinks: bool = False,
                 tp: TPGroup = SINGLE):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        if logit_softcap is not None and not float(logit_softcap) > 0.0:
            raise ValueError(f"logit_softcap must be a positive number or None, got {logit_softcap!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.ops = ops
        self.sliding_window = sliding_window
        self.logit_softcap = None if logit_softcap is None else float(logit_softcap)
        self.has_sinks = bool(sinks)
        if self.has_sinks:
            self.sinks = _sinks_param(num_heads, tp)
        self.fp8_kv = getattr(getattr(ops, "policy", None), "kv_cache", "auto") == "fp8"
        if self.fp8_kv:
            self.k_scale, self.v_scale = _kv_scale(), _kv_scale()

    @property
    def cache_kwargs(self) -> dict:
        """The keywords of every op that writes or reads the cache: the fp8 scales, or none."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale} if self.fp8_kv else {}

    @property
    def variant_kwargs(self) -> dict:
        """The keywords of this layer's attention variant (only those it has)."""
        kw = {}
        if self.sliding_window is not None:
            kw["sliding_window"] = self.sliding_window
        if self.logit_softcap is not None:
            kw["logit_softcap"] = self.logit_softcap
        if self.has_sinks:
            kw["sinks"] = self.sinks
        return kw

    @property
    def attention_kwargs(self) -> dict:
        """The keywords of every attention op call (``paged_attention``, ``rotary_paged_attention``): the cache's
        and the variant's."""
        return {**self.cache_kwargs, **self.variant_kwargs}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                cache_written: bool = False) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] (may be strided views of a fused qkv) -> [T, Hq, D].

        ``cache_written``: the caller already wrote k and v into the cache (``qk_norm_rotary_cache``)."""
        k_cache, v_cache = kv_cache  # [num_blocks, block_size, Hk, D] each
        # Kernels index q with dense strides; copying here is cheaper than a wrong answer.
        q = q.contiguous()
        kw = self.cache_kwargs
        if not cache_written:
            self.ops.reshape_and_cache(k.contiguous(), v.contiguous(), k_cache, v_cache, meta.slot_mapping, **kw)
        return self.ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, meta.max_query_len, meta.max_seq_len,
                                        self.scale, **kw, **self.variant_kwargs)

    def kv_spec(self, cache_dtype: str):
        """What this layer stores per token (turnout/kv/spec.py): k and v of its kv heads (this rank's under
        tensor parallelism) as ``cache_dtype``, read over its sliding window if it has one."""
        from turnout.kv.spec import FullAttentionSpec, SlidingWindowSpec

        window = getattr(self, "sliding_window", None)
        if window:
            return SlidingWindowSpec(self.num_kv_heads, self.head_dim, cache_dtype, window=int(window))
        return FullAttentionSpec(self.num_kv_heads, self.head_dim, cache_dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
                + (f", sliding_window={self.sliding_window}" if self.sliding_window is not None else "")
                + (f", logit_softcap={self.logit_softcap:g}" if self.logit_softcap is not None else "")
                + (", sinks" if self.has_sinks else "") + (", kv_cache=fp8" if self.fp8_kv else ""))
