"""Decompressed prefill for multi-head latent attention (vLLM's and SGLang's long-prefill path).

Absorbed attention (turnout/layers/mla.py) costs, per head and per (query, key) pair, 2 (L + R) FLOPs for the score
and 2 L for the output, plus 2 L (Dn + Dv) per query for W_UK / W_UV. Decompressed attention applies ``kv_b_proj``
to each context token's latent vector once (2 L (Dn + Dv) per key and head) and then costs 2 (Dn + R) + 2 Dv per
pair: at DeepSeek-V3's shape (L 512, R 64, Dn 128, Dv 128) 2176 against 640 FLOPs per pair, so a prefill chunk
of n new tokens over a context of c pays for the decompression once n (c - n) + n (n + 1) / 2 > 170 (c - n): a
fresh prompt always, a chunk over a cached prefix from about 170 new tokens.

The choice is made per sequence, once per step, before the layers run (``plan_latent_prefill``, called by the
model's forward; the plan rides in ``AttentionMetadata.latent_prefill`` to every layer): a sequence with more
than one new token goes decompressed where the FLOPs above say so (``mode="auto"``), always (``"decompressed"``)
or never (``"absorbed"``); one-token sequences (decode) stay absorbed. The per-head keys and values are materialised
for the whole context (not chunked), so a step decompresses at most ``DECOMPRESS_WORKSPACE_BYTES`` of them
(``LatentDims.max_keys``); further sequences run absorbed. Prefix hits and earlier chunks need nothing special: the whole context is read back from the latent
cache (``mla_gather_cache``, after this step's rows were written), so an fp8 cache is read as the absorbed
path reads it (its rows times ``kv_scale``).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

MLA_PREFILL_MODES = ("auto", "absorbed", "decompressed")
# The decompressed sequences' per-head keys and values are materialised for the whole context (not chunked with
# log-sum-exp merging as vLLM's workspace is): their bytes per step are bounded here; sequences past the bound run
# absorbed. DeepSeek's shape in bf16: 16 heads (V2-Lite, or V3 at TP=8) 15.5 KB a key, 34k keys; 128 heads 4.6k.
DECOMPRESS_WORKSPACE_BYTES = 512 << 20


@dataclass(frozen=True)
class LatentDims:
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    num_heads: int = 1  # this rank's
    elem_bytes: int = 2  # the compute dtype's

    @property
    def max_keys(self) -> int:
        """Context tokens one step may decompress: the gathered row (L + R), and per head k_nope + v out of
        kv_b_proj and the key (Dn + R) built from them."""
        per_key = self.kv_lora_rank + self.rope_dim + self.num_heads * (2 * self.nope_dim + self.rope_dim + self.v_dim)
        return DECOMPRESS_WORKSPACE_BYTES // (per_key * self.elem_bytes)


# What a FLOP of the absorbed path costs against one of the decompressed path. Measured on an H100 (2026-12-07,
# benchmarks/mla_prefill.py at DeepSeek-V3's attention shape, bf16): the absorbed prefill ran at 47-68 TFLOP/s
# of this model's count, the decompressed one at 200-344 (its GEMMs and varlen attention use the tensor cores
# better): 4.2-6.2x. The lower end is taken, so a decode step (n = 1) stays absorbed by far and the crossover
# sits near 35 new tokens over a 10k context (the FLOP count alone put it near 170; decompressed was already
# 1.9x faster at 64 x 16k and 3.7x at 128 x 8k).
ABSORBED_FLOP_COST = 4.0


def decompress_pays(n: int, ctx: int, d: LatentDims) -> bool:
    """Whether n new tokens over a context of ctx (the n included) cost less time decompressed: FLOPs counted,
    the absorbed ones weighed by ABSORBED_FLOP_COST."""
    pairs = n * (ctx - n) + n * (n + 1) // 2
    up = 2 * d.kv_lora_rank * (d.nope_dim + d.v_dim)  # one token through W_UK and W_UV
    absorbed = pairs * (4 * d.kv_lora_rank + 2 * d.rope_dim) + n * up
    decompressed = pairs * 2 * (d.nope_dim + d.rope_dim + d.v_dim) + ctx * up
    return decompressed < ABSORBED_FLOP_COST * absorbed


@dataclass(frozen=True)
class LatentPrefillPlan:
    """One step's decompressed sequences (their token rows, block tables, lengths, packed key offsets) and the
    absorbed rest (its token rows and metadata, or None). ``tokens`` None: the decompressed sequences are the
    whole step, in order."""

    tokens: torch.Tensor | None  # [Td] i64 rows of the step's tokens
    block_tables: torch.Tensor  # [Bd, MB] i32
    seq_lens: torch.Tensor  # [Bd] i32
    query_start_loc: torch.Tensor  # [Bd + 1] i32, into the Td rows
    key_start_loc: torch.Tensor  # [Bd + 1] i32, into the packed context
    max_query_len: int
    max_seq_len: int
    total_keys: int
    absorbed_tokens: torch.Tensor | None = None  # [Ta] i64
    absorbed_meta: object | None = None  # AttentionMetadata of the absorbed sequences


def plan_latent_prefill(meta, mode: str, dims: LatentDims) -> LatentPrefillPlan | None:
    """The step's plan; None where every sequence runs absorbed: always at decode (``max_query_len`` 1) and where
    the metadata has no host copies of the lengths (a CUDA graph's multi-token capture: planning would sync)."""
    if mode == "absorbed" or meta.max_query_len <= 1:
        return None
    if meta.query_start_loc_host is None or meta.seq_lens_host is None:
        return None
    qsl, lens = list(meta.query_start_loc_host), list(meta.seq_lens_host)
    chosen, rest, keys = [], [], 0
    for b, ctx in enumerate(lens):
        n = qsl[b + 1] - qsl[b]
        if n > 1 and keys + ctx <= dims.max_keys and (mode == "decompressed" or decompress_pays(n, ctx, dims)):
            chosen.append(b)
            keys += ctx
        else:
            rest.append(b)
    if not chosen:
        return None
    dev = meta.seq_lens.device

    def ints(values, dtype=torch.int32):
        host = torch.tensor(values, dtype=dtype)
        if dev.type == "cpu":
            return host
        # pinned and non-blocking: a pageable copy would wait for the device (the previous step, under async
        # scheduling) before this step's layers are launched
        try:
            host = host.pin_memory()
        except RuntimeError:  # a device without pinned host memory: a plain copy
            return host.to(dev)
        return host.to(dev, non_blocking=True)

    def rows(seqs):
        return ints(list(itertools.chain.from_iterable(range(qsl[b], qsl[b + 1]) for b in seqs)), torch.int64)

    def starts(values):
        return [0, *itertools.accumulate(values)]

    d_qlens = [qsl[b + 1] - qsl[b] for b in chosen]
    d_lens = [lens[b] for b in chosen]
    whole = not rest
    sel = None if whole else ints(chosen, torch.int64)
    plan = dict(tokens=None if whole else rows(chosen),
                block_tables=meta.block_tables if whole else meta.block_tables[sel],
                seq_lens=meta.seq_lens if whole else meta.seq_lens[sel],
                query_start_loc=meta.query_start_loc if whole else ints(starts(d_qlens)),
                key_start_loc=ints(starts(d_lens)), max_query_len=max(d_qlens), max_seq_len=max(d_lens),
                total_keys=keys)
    if rest:
        a_rows, a_sel = rows(rest), ints(rest, torch.int64)
        a_qlens = [qsl[b + 1] - qsl[b] for b in rest]
        a_lens = [lens[b] for b in rest]
        plan["absorbed_tokens"] = a_rows
        plan["absorbed_meta"] = dataclasses.replace(
            meta, slot_mapping=meta.slot_mapping[a_rows], block_tables=meta.block_tables[a_sel],
            seq_lens=meta.seq_lens[a_sel], query_start_loc=ints(starts(a_qlens)), max_query_len=max(a_qlens),
            max_seq_len=max(a_lens), seq_lens_host=tuple(a_lens), query_start_loc_host=tuple(starts(a_qlens)),
            latent_prefill=None)
    return LatentPrefillPlan(**plan)


def decompressed_attention(layer, q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                           plan: LatentPrefillPlan) -> torch.Tensor:
    """The decompressed sequences' attention output [Td, H, Dv]: their whole context out of the latent cache,
    through ``kv_b_proj`` into per-head keys (with the shared rope key) and values, then causal attention.
    q_nope [Td, H, Dn], q_pe [Td, H, R]: the decompressed sequences' queries (rope applied)."""
    ops, heads, lat = layer.ops, layer.num_heads, layer.kv_lora_rank
    rows = ops.mla_gather_cache(latent_cache, plan.block_tables, plan.seq_lens, plan.key_start_loc,
                                plan.max_seq_len, plan.total_keys, q_nope.dtype,
                                **layer.cache_kwargs)  # [S, L + R]
    s = rows.shape[0]
    kv = layer.kv_b_proj(rows[:, :lat]).view(s, heads, layer.nope_dim + layer.v_dim)  # [S, H, Dn + Dv]
    k_pe = rows[:, lat:].view(s, 1, layer.rope_dim).expand(s, heads, layer.rope_dim)
    key = torch.cat([kv[..., : layer.nope_dim], k_pe], dim=-1)  # [S, H, Dn + R]
    value = kv[..., layer.nope_dim:]  # [S, H, Dv] (a strided view: the op reads rows by stride)
    query = torch.cat([q_nope, q_pe], dim=-1)  # [Td, H, Dn + R]
    return ops.varlen_attention(query, key, value, plan.query_start_loc, plan.key_start_loc, plan.max_query_len,
                                plan.max_seq_len, layer.scale)
