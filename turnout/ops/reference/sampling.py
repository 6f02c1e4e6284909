"""Sampling, with noise that is a pure function of (seed, step, token id).

Random sampling uses the exponential race: token = argmax(p_i / E_i) with E_i ~ Exp(1), which draws
from p. E_i = -log(u_i), u_i from a counter-based 32-bit hash of (seed, step, i), so that every
implementation (torch, Triton, vendor) draws the same token for the same request state, whatever
else is in the batch, and a preempted request recomputes exactly the same tokens.
"""

import torch

from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 integer hash on uint32 values held in int64."""
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    seeds = seeds.long()
    return mix32((seeds & M32) ^ mix32(((seeds >> 32) & M32) ^ mix32(steps.long() & M32)))


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """u [B, V] in (0, 1): 23 bits of hash(row key, token id)."""
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = mix32(row_keys(seeds, steps)[:, None] ^ ((idx * GOLDEN) & M32)[None, :])
    # 23 bits: the largest u is 1 - 2^-24, exact in float32. (24 bits would round the top value to
    # 1.0, making E = -0.0 and p / E = NaN for a masked token, which argmax would then pick.)
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] int64.

    Per row: temperature 0 is greedy (argmax, lowest id on ties). Otherwise logits / temperature, then
    top-k (k <= 0 or k >= V: off), top-p over the survivors (keep the smallest set of most likely
    tokens whose probability reaches top_p, at least one), min-p (drop tokens below min_p times the top
    probability), then draw with the hashed exponential race. Ties in ranking break to the lower id.
    """
    logits = logits.float()
    b, v = logits.shape
    greedy = logits.argmax(-1)
    t = temperature.float().clamp_min(1e-6)[:, None]
    scaled = logits / t
    order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    sorted_logits, sorted_idx = order.values, order.indices
    rank = torch.arange(v, device=logits.device)[None, :]
    k = top_k.long()[:, None]
    k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)
    mask = rank >= k
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # Keep a token if the mass strictly before it is still below top_p.
    before = probs.cumsum(-1) - probs
    # top_p >= 1 is off (a float cumsum can reach 1.0 before the tail; that must not cut it)
    mask = mask | ((before >= top_p.float()[:, None]) & (rank > 0) & (top_p.float()[:, None] < 1.0))
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    probs = sorted_logits.softmax(-1)
    mask = mask | (probs < min_p.float()[:, None] * probs[:, :1])
    keep = torch.zeros_like(mask).scatter(1, sorted_idx, ~mask)  # back to vocab order
    p = (scaled - scaled.max(-1, keepdim=True).values).exp().masked_fill(~keep, 0.0)
    e = -torch.log(uniform_noise(seeds, steps, v))
    drawn = (p / e).argmax(-1)
    return torch.where(temperature.float() == 0, greedy, drawn)


def _samples(device, dtype, gen):
    for b, v in [(1, 50), (6, 1000), (4, 5003)]:
        logits = randn((b, v), torch.float32, device, gen, 3.0)
        temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 2.0][:b], device=device)
        top_k = torch.tensor([0, 0, 20, 5, 3, 0][:b], dtype=torch.int32, device=device)
        top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 0.8][:b], device=device)
        min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.1][:b], device=device)
        seeds = torch.randint(0, 2**62, (b,), generator=gen).to(device)
        steps = torch.randint(0, 1000, (b,), generator=gen).to(device)
        yield SampleCase(f"B{b}-V{v}", (logits, temp, top_k, top_p, min_p, seeds, steps))


SAMPLE = OpSpec("sample", sample, _samples, tolerance={"float32": (0.0, 0.0)}, dtypes=("float32",),
                doc="greedy / temperature / top-k / top-p / min-p sampling with hashed per-request noise")
