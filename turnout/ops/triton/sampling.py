"""Sampling without sorting the vocabulary: one program per row, a few streaming passes over its logits
(the first, which is all greedy decoding needs, spread over one program per 4096 ids).

top-k, top-p and min-p each keep a prefix of the tokens ranked by scaled logit (ties to the lower id),
so the kept set is "every token above a threshold value, plus the first n tokens at it". The threshold is
found by bisection over the order-preserving 32-bit integer image of the float32 scaled logits, each step
one pass that weighs the tokens above the midpoint (a count for top-k, probability mass for top-p); it
stops as soon as one token is left between the bounds, or the bounds are adjacent keys. Then the noise of
the reference (a counter-based uint32 hash of (seed, step, token id)) draws with the exponential race,
argmax(p / E). Nothing leaves the device; the result matches ``reference.sampling.sample`` token for token
(up to float rounding on measure-zero knife edges).
"""

import torch
import triton
import triton.language as tl

INT32_MIN = tl.constexpr(-2147483648)
INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (multiplications wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _key(s):
    """float32 -> int32 with the same order (for non-NaN values; -0.0 and +0.0 are one key)."""
    b = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unkey(k):
    b = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(base, offs, ok, t):
    x = tl.load(base + offs, mask=ok, other=float("-inf"))
    return tl.div_rn(x, t)


@triton.jit
def _bisect(base, V, t, m, tau, lo, hi, cnt, P, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """The smallest token key x in (lo, hi] with W(x) < P, where W(x) is the weight of the candidates
    (tokens with key >= tau) whose key is > x: 1 per token, or exp(s - m) if MASS. Requires W(lo) >= P
    and W(hi) < P; cnt is the number of candidates with a key in (lo, hi]. Ties at tau are handled by the
    caller (W never counts tau itself here because x >= tau whenever it matters)."""
    while (cnt > 1) & (hi.to(tl.int64) - lo.to(tl.int64) > 1):
        mid = ((lo.to(tl.int64) + hi.to(tl.int64)) >> 1).to(tl.int32)
        w_mid = tl.zeros([], dtype=tl.float32)
        c_lo = tl.zeros([], dtype=tl.int32)
        c_hi = tl.zeros([], dtype=tl.int32)
        max_lo = tl.full([], INT32_MIN, tl.int32)
        min_hi = tl.full([], INT32_MAX, tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            s = _scaled(base, offs, ok, t)
            key = _key(s)
            cand = ok & (key >= tau)
            above = cand & (key > mid)
            if MASS:
                w_mid += tl.sum(tl.where(above, tl.exp(s - m), 0.0), 0)
            else:
                w_mid += tl.sum(above.to(tl.float32), 0)
            in_lo = cand & (key > lo) & (key <= mid)
            in_hi = above & (key <= hi)
            c_lo += tl.sum(in_lo.to(tl.int32), 0)
            c_hi += tl.sum(in_hi.to(tl.int32), 0)
            max_lo = tl.maximum(max_lo, tl.max(tl.where(in_lo, key, INT32_MIN), 0))
            min_hi = tl.minimum(min_hi, tl.min(tl.where(in_hi, key, INT32_MAX), 0))
        if w_mid < P:
            hi = mid
            cnt = c_lo
            single = max_lo
        else:
            lo = mid
            cnt = c_hi
            single = min_hi
        if cnt == 1:  # one token left in (lo, hi]: it is the answer (W is the same at it as at hi)
            hi = single
    return hi


@triton.jit
def _stats_at(base, V, t, m, tau, x, BLOCK: tl.constexpr):
    """Over candidates (key >= tau): count and mass strictly above key x, and the count at x."""
    c_above = tl.zeros([], dtype=tl.int32)
    c_at = tl.zeros([], dtype=tl.int32)
    mass_above = tl.zeros([], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < V
        s = _scaled(base, offs, ok, t)
        key = _key(s)
        cand = ok & (key >= tau)
        above = cand & (key > x)
        c_above += tl.sum(above.to(tl.int32), 0)
        c_at += tl.sum((cand & (key == x)).to(tl.int32), 0)
        mass_above += tl.sum(tl.where(above, tl.exp(s - m), 0.0), 0)
    return c_above, c_at, mass_above


@triton.jit
def _row_stats_kernel(LOGITS, PART_MAX, PART_ID, PART_MIN, V, stride_row, num_chunks, CHUNK: tl.constexpr):
    """One program per (row, chunk of CHUNK ids): the chunk's max, its lowest id at the max, and its min.
    A 152k vocabulary is 38 programs instead of 38 serial iterations of one (greedy decode's whole cost)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(LOGITS + row.to(tl.int64) * stride_row + offs, mask=offs < V, other=float("-inf"))
    cmax = tl.max(x, 0)
    part = row * num_chunks + chunk
    tl.store(PART_MAX + part, cmax)
    tl.store(PART_ID + part, tl.min(tl.where(x == cmax, offs, INT32_MAX), 0))
    tl.store(PART_MIN + part, tl.min(tl.where(offs < V, x, float("inf")), 0))


@triton.jit
def _sample_kernel(LOGITS, TEMP, TOP_K, TOP_P, MIN_P, SEEDS, STEPS, OUT, V, stride_row, PART_MAX, PART_ID,
                   PART_MIN, num_chunks, NC_PAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_row
    temp = tl.load(TEMP + row).to(tl.float32)

    # Pass 1 (done by _row_stats_kernel, one program per chunk): greedy argmax (lowest id on ties), the row
    # max and min, from the chunks' own. Chunks are in id order and each holds its lowest id at its max, so
    # the lowest chunk id among the chunks at the row max is the row's.
    offs_c = tl.arange(0, NC_PAD)
    c_ok = offs_c < num_chunks
    part = row * num_chunks + offs_c
    chunk_max = tl.load(PART_MAX + part, mask=c_ok, other=float("-inf"))
    best = tl.max(chunk_max, 0)
    best_id = tl.min(tl.where(c_ok & (chunk_max == best), tl.load(PART_ID + part, mask=c_ok, other=0), INT32_MAX), 0)
    best_id = tl.where(best_id == INT32_MAX, 0, best_id)  # every logit -inf (or NaN): token 0, as before
    least = tl.min(tl.load(PART_MIN + part, mask=c_ok, other=float("inf")), 0)
    token = best_id.to(tl.int64)

    if temp != 0.0:
        t = tl.maximum(temp, 1e-6)
        m = tl.div_rn(best, t)  # x -> x / t is monotone, so this is the max scaled logit
        top_key = _key(m)
        # Below every token: the bisections start here (W there is everything, so >= their targets).
        floor_key = tl.maximum(_key(tl.div_rn(least, t)), INT32_MIN + 1) - 1
        k = tl.load(TOP_K + row).to(tl.int32)
        top_p = tl.load(TOP_P + row).to(tl.float32)
        min_p = tl.load(MIN_P + row).to(tl.float32)

        # The kept set: key > tau, plus the first n_tau tokens (by id) with key == tau.
        tau = tl.full([], INT32_MIN, tl.int32)
        n_tau = tl.full([], INT32_MAX, tl.int32)
        n_cand = tl.zeros([], dtype=tl.int32) + V
        mass = tl.zeros([], dtype=tl.float32)
        if (k > 0) & (k < V):
            tau = _bisect(base, V, t, m, tau, floor_key, top_key, n_cand,
                          k.to(tl.float32), False, BLOCK)
            c_above, c_at, mass_above = _stats_at(base, V, t, m, INT32_MIN, tau, BLOCK)
            n_tau = k - c_above
            n_cand = c_above + c_at
            mass = mass_above + n_tau.to(tl.float32) * tl.exp(_unkey(tau) - m)
        if top_p < 1.0:
            if tau == INT32_MIN:  # no top-k: the mass of the whole row
                c_above, c_at, mass = _stats_at(base, V, t, m, INT32_MIN, INT32_MIN, BLOCK)
            P = top_p * mass
            lo = tl.where(tau == INT32_MIN, floor_key, tau - 1)
            x = _bisect(base, V, t, m, tau, lo, top_key, n_cand, P, True, BLOCK)
            c_above, c_at, mass_above = _stats_at(base, V, t, m, tau, x, BLOCK)
            if x == tau:
                c_at = tl.minimum(c_at, n_tau)
            # Tokens tied at x: keep the i-th (by id) while the mass before it is still < P.
            w0 = tl.exp(_unkey(x) - m)
            n_x = c_at
            if w0 > 0.0:
                n_x = tl.minimum(tl.maximum(tl.ceil((P - mass_above) / w0).to(tl.int32), 1), c_at)
            tau = x
            n_tau = n_x

        # Final pass: min-p, the hashed exponential race, argmax(p / E) with the lowest id on ties.
        seed = tl.load(SEEDS + row).to(tl.int64)
        step = tl.load(STEPS + row).to(tl.int64)
        seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        row_key = _mix32(seed_lo ^ _mix32(seed_hi ^ _mix32((step & 0xFFFFFFFF).to(tl.uint32))))
        golden = tl.full([], 0x9E3779B1, tl.uint32)
        best_r = tl.full([], -1.0, tl.float32)
        drawn = tl.zeros([], dtype=tl.int32)
        ties_seen = tl.zeros([], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            s = _scaled(base, offs, ok, t)
            key = _key(s)
            at = ok & (key == tau)
            tie_rank = ties_seen + tl.cumsum(at.to(tl.int32), 0) - at.to(tl.int32)
            ties_seen += tl.sum(at.to(tl.int32), 0)
            p = tl.exp(s - m)
            keep = ok & ((key > tau) | (at & (tie_rank < n_tau))) & (p >= min_p)
            p = tl.where(keep, p, 0.0)
            h = _mix32(row_key ^ (offs.to(tl.uint32) * golden))
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits: u < 1 exactly
            r = tl.div_rn(p, -tl.log(u))
            r = tl.where(ok, r, -1.0)
            cmax = tl.max(r, 0)
            cid = tl.min(tl.where(r == cmax, offs, INT32_MAX), 0)
            take = cmax > best_r
            drawn = tl.where(take, cid, drawn)
            best_r = tl.maximum(best_r, cmax)
        token = drawn.to(tl.int64)
    tl.store(OUT + row, token)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    b, v = logits.shape
    out = torch.empty((b,), dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        logits = logits.float().contiguous()
    block = min(triton.next_power_of_2(v), 4096)
    num_chunks = triton.cdiv(v, block)
    part_max = torch.empty((b, num_chunks), dtype=torch.float32, device=logits.device)
    part_min = torch.empty_like(part_max)
    part_id = torch.empty((b, num_chunks), dtype=torch.int32, device=logits.device)
    warps = 8 if block >= 2048 else 4
    _row_stats_kernel[(b, num_chunks)](logits, part_max, part_id, part_min, v, logits.stride(0), num_chunks,
                                       CHUNK=block, num_warps=warps)
    _sample_kernel[(b,)](logits, temperature, top_k, top_p, min_p, seeds, steps, out, v, logits.stride(0),
                         part_max, part_id, part_min, num_chunks, NC_PAD=triton.next_power_of_2(num_chunks),
                         BLOCK=block, num_warps=warps)
    return out
