"""Paged attention: causal attention of new tokens over a paged KV cache (decode and prefill with prefix); the
host side: tiles, split count, variants, launch. The kernel is turnout/ops/triton/attention_kernel.py (one program
per query tile, sequence and KV head with its whole GQA group; online softmax over BLOCK_N-token KV tiles).

Decode with few sequences and long contexts leaves most of the GPU idle with one program per
(sequence, KV head), so it splits the context across programs (flash-decoding): each split writes a
normalised partial output and its log-sum-exp, and a second kernel merges them (both in
turnout/ops/triton/attention_split.py). Whether to split is
chosen from host ints (batch size, KV heads, max_seq_len, the SM count), so there is no device sync.
The split count is the implementation's declared choice ``num_splits`` (turnout/ops/triton/__init__.py:
CHOICES): ``turnout ops`` shows it and ``TURNOUT_OPS="paged_attention.num_splits=1"`` fixes it.
"""

from __future__ import annotations

import functools
from typing import Mapping

import torch
import triton

from turnout import envs
from turnout.ops.reference.attention_variants import check_variants
from turnout.ops.triton._pdl import pdl_args
from turnout.ops.triton.attention_kernel import _paged_attn_kernel
from turnout.ops.triton.attention_split import _SPLIT_MAX_Q, _num_sms, _split_reduce_kernel, choose_num_splits
from turnout.ops.triton.cache import ROUND_FP8, fp8_kv_args

LOG2E = 1.4426950408889634  # scores run in base 2: the kernel takes scale * log2(e)

# An fp8 cache's V read as 16-bit pairs of columns (the kernel's V_PAIRS), in one-token (decode) tiles only: with
# prefill tiles (BLOCK_Q > 1) the pairs gave wrong outputs on the H200 in one conformance case (D 64, 7 and 3 new
# tokens over 40 and 19: max error 1.0, where the interpreter matches the reference) and an illegal address in
# another, under Triton 3.6; the decode tiles pass every case there. benchmarks/fp8_kv.py turns it off to time the
# byte-wise tile beside it.
V_PAIRS = True
TUNING_ENV = "TURNOUT_ATTN_DECODE"  # {"num_splits", "block_n", "num_warps", "num_stages"} (turnout/envs.py)
NO_TUNING: Mapping[str, int] = {}  # the built-in decode tiles (_tiles) and split rule


def _tiles(max_query_len: int, group: int, head_dim: int) -> dict:
    """Tile sizes: decode uses one token per program (rows = the GQA group, padded to 16 for tl.dot);
    prefill packs BLOCK_M // group tokens per program. Over an fp8 cache a 128-token decode tile with 3 stages
    (TURNOUT_ATTN_DECODE='{"block_n": 128, "num_stages": 3}') read Qwen3-8B's geometry 6-9 % faster on the H200
    (0.195 -> 0.177 ms at 64 x 4096, 0.210 -> 0.198 ms at 256 x 1280; docs/benchmarks.md, "the fp8 KV cache read
    as 16-bit pairs"); it is not the default because its conformance has not run on a GPU yet (the 64-token
    tile's has)."""
    g_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if d_pad <= 128 else 32
    if max_query_len <= 1:
        g_tile = min(g_pad, 64)
        return dict(G_TILE=g_tile, BLOCK_Q=1, BLOCK_M=max(16, g_tile), BLOCK_N=block_n, D_PAD=d_pad,
                    num_warps=4, num_stages=2)
    block_m = 128 if d_pad <= 64 else 64
    g_tile = min(g_pad, block_m)
    return dict(G_TILE=g_tile, BLOCK_Q=block_m // g_tile, BLOCK_M=block_m, BLOCK_N=block_n, D_PAD=d_pad,
                num_warps=4, num_stages=2)


def paged_attention_impl(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         max_query_len: int, max_seq_len: int, scale: float,
                         num_splits: int | None = None, rope: tuple | None = None, k_scale=None,
                         v_scale=None, *, sliding_window: int | None = None, logit_softcap: float | None = None,
                         sinks: torch.Tensor | None = None,
                         decode_tuning: Mapping[str, int] = NO_TUNING) -> torch.Tensor:
    """paged_attention with the split count exposed (None: choose; 1: never split). ``rope`` (decode only):
    (positions, key, value, q_weight, k_weight, eps, cos_sin_cache, is_neox, slot_mapping) of
    ``rotary_paged_attention``; then ``query`` is the raw q and the kernel does the rest. k_scale / v_scale:
    an fp8 cache's (turnout/ops/kv_cache.py). sliding_window / logit_softcap / sinks: the variants
    (turnout/ops/reference/attention_variants.py). ``decode_tuning``: fixed decode tiles (``with_decode_tuning``)."""
    check_variants(sliding_window, logit_softcap, sinks, query.shape[1])
    num_tokens, hq, head_dim = query.shape
    out = torch.empty((num_tokens, hq, head_dim), dtype=query.dtype, device=query.device)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_query_len <= 0:
        return out
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs a unit stride on the head dimension")
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    group = hq // hk
    ks, vs, fp8 = fp8_kv_args(k_cache, k_scale, v_scale, query)
    f16_dot = fp8 and query.dtype in (torch.bfloat16, torch.float16)
    v_pairs = (f16_dot and V_PAIRS and max_query_len <= 1 and head_dim % 2 == 0 and head_dim > 16
               and all(st % 2 == 0 for st in v_cache.stride()[:3]))  # whole 16-bit pairs
    cfg = _tiles(max_query_len, group, head_dim)
    num_head_tiles = triton.cdiv(group, cfg["G_TILE"])
    if max_query_len <= _SPLIT_MAX_Q:
        cfg.update({key.upper() if key == "block_n" else key: decode_tuning[key]
                    for key in ("block_n", "num_warps", "num_stages") if key in decode_tuning})
        if num_splits is None:
            num_splits = decode_tuning.get("num_splits")
    # the keys one query reads: the window bounds them, however long the context
    kv_span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(batch, hk * num_head_tiles, max_query_len, kv_span,
                                       _num_sms(query.device.type, query.device.index), cfg["BLOCK_N"])
    num_splits = min(num_splits, triton.cdiv(kv_span, cfg["BLOCK_N"]))  # no more splits than KV tiles
    split = num_splits > 1
    if split:
        ws_o = torch.empty((num_tokens, hq, num_splits, head_dim), dtype=torch.float32, device=query.device)
        ws_lse = torch.empty((num_tokens, hq, num_splits), dtype=torch.float32, device=query.device)
    else:
        num_splits = 1
        ws_o, ws_lse = out.view(num_tokens, hq, 1, head_dim), out  # unused
    precision = "ieee" if query.dtype == torch.float32 else None  # None: the target's default for half types
    grid = (triton.cdiv(max_query_len, cfg["BLOCK_Q"]), batch, hk * num_head_tiles * num_splits)
    variants = {}  # only the variants in use: the default call compiles the kernel as it always was
    if sliding_window is not None:
        variants["WINDOW"] = int(sliding_window)
    if logit_softcap is not None:
        variants["SOFTCAP"] = float(logit_softcap)
    if sinks is not None:
        if sinks.device != query.device or not sinks.is_contiguous():
            sinks = sinks.to(query.device).contiguous()
        variants["HAS_SINKS"] = True
    if rope is not None:
        if cfg["BLOCK_Q"] != 1:
            raise ValueError("paged attention with RoPE fused takes one new token per sequence (decode)")
        positions, key, value, q_weight, k_weight, eps, cos_sin_cache, is_neox, slot_mapping = rope
        if key.stride(-1) != 1 or value.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
            raise ValueError("rotary_paged_attention needs a unit stride on the head dimension")
        rot_dim = cos_sin_cache.shape[-1]
        rope_args = (positions, cos_sin_cache, q_weight if q_weight is not None else query,
                     k_weight if k_weight is not None else query, key, value, slot_mapping, float(eps),
                     cos_sin_cache.stride(0), key.stride(0), key.stride(1), value.stride(0), value.stride(1))
        rope_consts = dict(ROPE=True, HAS_NORM=q_weight is not None, IS_NEOX=bool(is_neox), ROT=rot_dim,
                           HALF=rot_dim // 2)
    else:
        rope_args = (query,) * 7 + (0.0,) + (0,) * 5
        rope_consts = dict(ROPE=False, HAS_NORM=False, IS_NEOX=True, ROT=1, HALF=1)
    _paged_attn_kernel[grid](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, ws_o, ws_lse,
        scale * LOG2E, num_splits,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0), ws_o.stride(0), ws_o.stride(1), ws_o.stride(2), ws_lse.stride(0), ws_lse.stride(1),
        *rope_args, ks, vs, sinks if sinks is not None else query,
        G=group, G_TILE=cfg["G_TILE"], NUM_HEAD_TILES=num_head_tiles, BLOCK_Q=cfg["BLOCK_Q"],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BS=block_size, HEAD_D=head_dim, D_PAD=cfg["D_PAD"],
        SPLIT=split, PRECISION=precision, **rope_consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        ONE_TOKEN=max_query_len == 1 and num_tokens == batch, FP8_KV=fp8, ROUND=fp8 and ROUND_FP8,
        F16_DOT=f16_dot, V_PAIRS=v_pairs, **variants, **pdl_args(query, "attention"))
    if split:
        _split_reduce_kernel[(num_tokens, hq)](
            ws_o, ws_lse, out, num_splits, ws_o.stride(0), ws_o.stride(1), ws_o.stride(2), ws_lse.stride(0),
            ws_lse.stride(1), out.stride(0), out.stride(1), sinks if sinks is not None else ws_lse,
            S_PAD=triton.next_power_of_2(num_splits), HEAD_D=head_dim, D_PAD=cfg["D_PAD"],
            HAS_SINKS=sinks is not None, num_warps=4, **pdl_args(query, "attention_merge"))
    return out


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
                    sliding_window: int | None = None, logit_softcap: float | None = None,
                    sinks: torch.Tensor | None = None, num_splits: int | None = None,
                    decode_tuning: Mapping[str, int] = NO_TUNING) -> torch.Tensor:
    """``num_splits`` (the policy's ``paged_attention.num_splits``, bound once by the op table): None chooses;
    it applies to decode only (prefill is never split). ``decode_tuning``: bound once too (with_decode_tuning)."""
    if max_query_len > _SPLIT_MAX_Q:
        num_splits = None
    return paged_attention_impl(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                                max_seq_len, scale, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale,
                                sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
                                decode_tuning=decode_tuning)


def rotary_paged_attention(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                           cos_sin_cache: torch.Tensor, is_neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                           scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           *, sliding_window: int | None = None, logit_softcap: float | None = None,
                           sinks: torch.Tensor | None = None, num_splits: int | None = None,
                           decode_tuning: Mapping[str, int] = NO_TUNING) -> torch.Tensor:
    """See turnout/ops/reference/attention.py. Decode (one new token per sequence): one attention kernel
    that also normalises and rotates q and the new k and writes k and v into the cache. Otherwise the
    separate kernels, on copies of q and k (the op leaves its inputs alone)."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rotary_paged_attention: give both q_weight and k_weight, or neither")
    variants = dict(sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks)
    check_variants(sliding_window, logit_softcap, sinks, query.shape[1])
    if max_query_len == 1 and query.shape[0] > 0:
        if q_weight is not None:
            q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
        return paged_attention_impl(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                                    max_seq_len, scale, num_splits=num_splits,
                                    rope=(positions, key, value, q_weight, k_weight, eps, cos_sin_cache, is_neox,
                                          slot_mapping), k_scale=k_scale, v_scale=v_scale, **variants,
                                    decode_tuning=decode_tuning)
    from turnout.ops.triton.cache import reshape_and_cache
    from turnout.ops.triton.rotary import qk_norm_rotary_cache, rotary_embedding

    q, k = query.clone(), key.clone()
    if q_weight is not None:
        qk_norm_rotary_cache(positions, q, k, value, q_weight, k_weight, eps, cos_sin_cache, is_neox, k_cache,
                             v_cache, slot_mapping, k_scale, v_scale)
    else:
        rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
        reshape_and_cache(k, value.contiguous(), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                           scale, k_scale, v_scale, num_splits=num_splits, decode_tuning=decode_tuning, **variants)


def with_decode_tuning(fn):
    """``fn`` with the decode tiles of TURNOUT_ATTN_DECODE bound (``decode_tuning``), read from turnout.envs now,
    once: the op table resolves the Triton attention ops through the two factories below, so a launch never
    looks at a process global. Unset, ``fn`` itself (the built-in tiles)."""
    tuning = envs.get().attn_decode
    return functools.partial(fn, decode_tuning=dict(tuning)) if tuning else fn


def paged_attention_tuned():
    return with_decode_tuning(paged_attention)


def rotary_paged_attention_tuned():
    return with_decode_tuning(rotary_paged_attention)
