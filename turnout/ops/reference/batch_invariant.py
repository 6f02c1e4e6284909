"""Batch-invariant PyTorch implementations: a row's bits never depend on the other rows of the call.

Why the plain references are not: a BLAS picks its kernel (and so its reduction order) from the number of
rows (measured on this project's CPU: a float32 row of ``F.linear`` differs alone and inside 7 rows), torch
reductions pick their split from the tensor's size, and attention over a prefill chunk reduces over a
different key count than the same row at decode. The cure here is one idea applied everywhere: every call
the computation makes has ONE fixed shape in its rows dimension, whatever the batch.

* Row-wise ops (norms, rotary, sampling, routing, activation, linear): the rows go through the reference in
  tiles of ``ROW_TILE`` rows, the last one padded; a row's value then depends only on itself (its position in
  a tile does not change a fixed-shape call's reduction order: measured by the invariance tests).
* Attention: each query row reduces over its keys in ``KV_BLOCK`` blocks aligned to position 0, in order, with
  an online softmax; queries go in tiles of ``ROW_TILE`` rows. A block past a row's position is masked out
  entirely and contributes exactly nothing (scale 1, add 0), so a row sees the same arithmetic alone, inside a
  prefill chunk of any size, at decode, or over a cached prefix.
* MoE experts: each expert's GEMMs through the tiled linear, then a fixed-order per-token combine (slot 0,
  then 1, ...), never an order that depends on how many tokens went to an expert.

These run on every platform (fixed shapes make cuBLAS / torch's reductions choose the same way each call);
a platform supplies faster ones (turnout/ops/triton/batch_invariant.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turnout.ops.reference import norm as _norm
from turnout.ops.reference import rotary as _rotary
from turnout.ops.reference.cache import reshape_and_cache

ROW_TILE = 16  # rows per call of every row-wise computation
KV_BLOCK = 32  # keys per step of the attention reduction, aligned to position 0


def _tiles(n: int):
    for start in range(0, n, ROW_TILE):
        yield start, min(ROW_TILE, n - start)


def _pad(x: torch.Tensor, start: int, n: int, value=0) -> torch.Tensor:
    """Rows [start, start + n) of x as a new ROW_TILE-row tensor (pad rows filled with ``value``)."""
    out = torch.full((ROW_TILE, *x.shape[1:]), value, dtype=x.dtype, device=x.device)
    out[:n] = x[start:start + n]
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` in fixed ROW_TILE-row calls: y[i] depends on x[i] only."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    for start, n in _tiles(x2.shape[0]):
        out[start:start + n] = F.linear(_pad(x2, start, n), weight, bias)[:n]
    return out.view(*lead, weight.shape[0])


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(x2)
    for start, n in _tiles(x2.shape[0]):
        out[start:start + n] = _norm.rms_norm(_pad(x2, start, n), weight, eps)[:n]
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    for start, n in _tiles(x.shape[0]):
        xt, rt = _pad(x, start, n), _pad(residual, start, n)
        _norm.fused_add_rms_norm(xt, rt, weight, eps)
        x[start:start + n] = xt[:n]
        residual[start:start + n] = rt[:n]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from turnout.ops.reference.activation import silu_and_mul as ref

    out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)
    for start, n in _tiles(x.shape[0]):
        out[start:start + n] = ref(_pad(x, start, n))[:n]
    return out


def rotary_embedding(positions, query, key, cos_sin_cache, is_neox) -> None:
    for start, n in _tiles(positions.shape[0]):
        q, k = _pad(query, start, n), _pad(key, start, n)
        _rotary.rotary_embedding(_pad(positions, start, n), q, k, cos_sin_cache, is_neox)
        query[start:start + n] = q[:n]
        key[start:start + n] = k[:n]


def qk_norm_rotary(positions, query, key, q_weight, k_weight, eps, cos_sin_cache, is_neox) -> None:
    for start, n in _tiles(positions.shape[0]):
        q, k = _pad(query, start, n), _pad(key, start, n)
        _rotary.qk_norm_rotary(_pad(positions, start, n), q, k, q_weight, k_weight, eps, cos_sin_cache, is_neox)
        query[start:start + n] = q[:n]
        key[start:start + n] = k[:n]


def qk_norm_rotary_cache(positions, query, key, value, q_weight, k_weight, eps, cos_sin_cache, is_neox, k_cache,
                         v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    qk_norm_rotary(positions, query, key, q_weight, k_weight, eps, cos_sin_cache, is_neox)
    # a copy (or an element-wise fp8 quantisation): exact whatever the batch
    reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias=None):
    r = x if residual is None else x + residual
    normed = rms_norm(r, norm_weight, eps).to(x.dtype)
    return linear(normed, weight, bias), r, normed


def sample(logits, temperature, top_k, top_p, min_p, seeds, steps) -> torch.Tensor:
    from turnout.ops.reference.sampling import sample as ref

    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for start, n in _tiles(logits.shape[0]):
        # pad rows: greedy over zeros
        out[start:start + n] = ref(_pad(logits, start, n), _pad(temperature, start, n), _pad(top_k, start, n),
                                   _pad(top_p, start, n, 1.0), _pad(min_p, start, n), _pad(seeds, start, n),
                                   _pad(steps, start, n))[:n]
    return out


def select_experts(router_logits, top_k, *args, **kwargs):
    from turnout.ops.reference.routing import select_experts as ref

    t = router_logits.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    for start, n in _tiles(t):
        w, i = ref(_pad(router_logits, start, n), top_k, *args, **kwargs)
        weights[start:start + n], ids[start:start + n] = w[:n], i[:n]
    return weights, ids


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                    scale, k_scale=None, v_scale=None, *, sliding_window=None, logit_softcap=None,
                    sinks=None) -> torch.Tensor:
    """The contract of turnout/ops/reference/attention.py, with the fixed reduction of the module docstring
    (an fp8 cache dequantised element-wise first: the reduction is unchanged). With a sliding window the walk
    starts at the aligned block holding the tile's first window position: blocks before a row's own window
    are masked whole for it and leave it exactly as it was, so where the walk starts changes no row's bits; keys
    before every row's window are never read (zeros stand in)."""
    from turnout.ops.reference.attention_variants import check_variants, softcap, window_start
    from turnout.ops.reference.cache import from_cache

    check_variants(sliding_window, logit_softcap, sinks, query.shape[1])
    out = torch.empty_like(query)
    bs, hk, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    hq = query.shape[1]
    g = hq // hk
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    dev = query.device
    for b, kv_len in enumerate(lens):
        q_len = qsl[b + 1] - qsl[b]
        if q_len == 0:
            continue
        first = kv_len - q_len  # position of the sequence's first new token
        lo = window_start(first, sliding_window)
        fb, nblk = lo // bs, (kv_len + bs - 1) // bs
        blocks = block_tables[b, fb:nblk].long()
        padded = (kv_len + KV_BLOCK - 1) // KV_BLOCK * KV_BLOCK
        k = torch.zeros(padded, hk, d, dtype=torch.float32, device=dev)  # keys past kv_len: zeros, masked
        v = torch.zeros(padded, hk, d, dtype=torch.float32, device=dev)
        k[lo:kv_len] = from_cache(k_cache[blocks].reshape(-1, hk, d)[lo - fb * bs:kv_len - fb * bs], k_scale)
        v[lo:kv_len] = from_cache(v_cache[blocks].reshape(-1, hk, d)[lo - fb * bs:kv_len - fb * bs], v_scale)
        k, v = k.permute(1, 2, 0).contiguous(), v.permute(1, 0, 2).contiguous()  # [Hk, D, P], [Hk, P, D]
        for start, n in _tiles(q_len):
            qt = _pad(query[qsl[b]:qsl[b + 1]], start, n).float()  # [R, Hq, D]
            qt = qt.view(ROW_TILE, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g * ROW_TILE, d)
            pos = first + start + torch.arange(ROW_TILE, device=dev).clamp_max(n - 1)  # pad rows repeat the last
            pos = pos.repeat(g)[:, None]  # [g R, 1], rows ordered (group member, tile row)
            m = torch.full((hk, g * ROW_TILE), float("-inf"), device=dev)
            den = torch.zeros(hk, g * ROW_TILE, device=dev)
            acc = torch.zeros(hk, g * ROW_TILE, d, device=dev)
            walk_lo = window_start(first + start, sliding_window) // KV_BLOCK * KV_BLOCK
            for j in range(walk_lo, first + start + n, KV_BLOCK):
                s = softcap(torch.bmm(qt, k[:, :, j:j + KV_BLOCK]) * scale, logit_softcap)  # [Hk, g R, KV_BLOCK]
                kpos = j + torch.arange(KV_BLOCK, device=dev)[None, :]
                dead = kpos > pos
                if sliding_window is not None:
                    dead |= kpos <= pos - sliding_window
                s = s.masked_fill(dead, float("-inf"))
                m_new = torch.maximum(m, s.amax(-1))
                m_use = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays at 0
                alpha = torch.exp(m - m_use)
                p = torch.exp(s - m_use[..., None])
                den = den * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + torch.bmm(p, v[:, j:j + KV_BLOCK])
                m = m_new
            if sinks is not None:  # the sink joins the denominator only (turnout/ops/reference/attention_variants.py)
                sink = sinks.float().to(dev).view(hk, g, 1).expand(hk, g, ROW_TILE).reshape(hk, g * ROW_TILE)
                m_f = torch.maximum(m, sink)
                alpha = torch.exp(m - m_f)
                den = den * alpha + torch.exp(sink - m_f)
                acc = acc * alpha[..., None]
            o = (acc / den[..., None]).view(hk, g, ROW_TILE, d).permute(2, 0, 1, 3).reshape(ROW_TILE, hq, d)
            out[qsl[b] + start: qsl[b] + start + n] = o[:n].to(query.dtype)
    return out


def rotary_paged_attention(positions, query, key, value, q_weight, k_weight, eps, cos_sin_cache, is_neox, k_cache,
                           v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, max_query_len,
                           max_seq_len, scale, k_scale=None, v_scale=None, *, sliding_window=None,
                           logit_softcap=None, sinks=None) -> torch.Tensor:
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rotary_paged_attention: give both q_weight and k_weight, or neither")
    q, k = query.clone(), key.clone()
    if q_weight is not None:
        qk_norm_rotary(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, is_neox)
    else:
        rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    reshape_and_cache(k, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                           scale, k_scale, v_scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
                           sinks=sinks)


def combine_slots(pair_out: torch.Tensor) -> torch.Tensor:
    """[T, k, H] float32 -> [T, H]: slot 0 + slot 1 + ... in that order, whatever the routing."""
    out = pair_out[:, 0].clone()
    for j in range(1, pair_out.shape[1]):
        out += pair_out[:, j]
    return out


def moe_experts(hidden, w13, w2, topk_weights, topk_ids, lin=linear) -> torch.Tensor:
    """The contract of turnout/ops/reference/moe.py; ``lin``: the batch-invariant linear to use.

    Host-synchronous, like reference/moe.py: each expert's rows are found with ``nonzero`` (the fixed
    row tiles of ``lin`` need their count on the host). A sync-free form (every expert on every token,
    masked) costs num_experts / top_k times the work, so this stays the portable fallback: under CUDA
    graphs capture fails once and the steps run eagerly; triton.batch_invariant serves GPUs."""
    num_tokens, hidden_size = hidden.shape
    inter = w13.shape[1] // 2
    ids = topk_ids.long()
    pair_out = torch.zeros(num_tokens, ids.shape[1], hidden_size, dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = lin(hidden[tokens], w13[e])  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = lin(act, w2[e])  # [n, H]
        pair_out[tokens, slots] = y.float() * topk_weights[tokens, slots].float()[:, None]
    return combine_slots(pair_out).to(hidden.dtype)
