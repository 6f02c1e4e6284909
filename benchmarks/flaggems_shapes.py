"""Inputs at decode and prefill shapes for benchmarks/flaggems_ops.py: Qwen3-8B's dense layers (H 4096, I 12288,
32 query and 8 KV heads of 128) and Qwen3-30B-A3B's experts (H 2048, I 768, 128 experts, top 8), for every op
turnout's FlagGems plugin serves. ``inputs(op, phase, device)`` returns (args, kwargs)."""

from __future__ import annotations

import torch

from turnout.ops.reference.fp8 import quantize_fp8, quantize_weight
from turnout.ops.reference.moe_fp8 import make_experts
from turnout.ops.reference.rotary import make_cos_sin_cache

H, I, HQ, HK, D = 4096, 12288, 32, 8, 128
MOE_H, MOE_I, E, TOPK = 2048, 768, 128, 8
BS = 16
# phase -> (tokens, sequences, context per sequence): decode is 64 sequences of one new token over 1024 cached;
# prefill is 2 prompts of 2048 tokens
PHASES = {"decode": (64, 64, 1024), "prefill": (4096, 2, 2048)}
DTYPE = torch.bfloat16


def _randn(*shape, dtype=DTYPE, device="cuda", scale=1.0):
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _paged(phase, device):
    t, b, ctx = PHASES[phase]
    q_len = t // b
    blocks = -(-ctx // BS)
    k_cache, v_cache = (_randn(b * blocks + 1, BS, HK, D, device=device) for _ in range(2))
    tables = torch.randperm(b * blocks, device=device).view(b, blocks).to(torch.int32)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(0, t + 1, q_len, dtype=torch.int32, device=device)
    slots = torch.randperm(b * blocks * BS, device=device)[:t]  # distinct slots anywhere in the cache
    return k_cache, v_cache, tables, seq_lens, qsl, q_len, ctx, slots


def inputs(op: str, phase: str, device="cuda"):
    t = PHASES[phase][0]
    if op == "rms_norm":
        return (_randn(t, H, device=device), _randn(H, device=device) + 1, 1e-6), {}
    if op == "fused_add_rms_norm":
        return (_randn(t, H, device=device), _randn(t, H, device=device), _randn(H, device=device) + 1, 1e-6), {}
    if op == "silu_and_mul":
        return (_randn(t, 2 * I, device=device),), {}
    if op == "rotary_embedding":
        qkv = _randn(t, (HQ + 2 * HK) * D, device=device)  # q and k as views of the fused projection
        q, k = qkv[:, : HQ * D].view(t, HQ, D), qkv[:, HQ * D: (HQ + HK) * D].view(t, HK, D)
        pos = torch.randint(0, 4096, (t,), device=device)
        return (pos, q, k, make_cos_sin_cache(D, 40960).to(device), True), {}
    if op == "reshape_and_cache":
        k_cache, v_cache, *_, slots = _paged(phase, device)
        return (_randn(t, HK, D, device=device), _randn(t, HK, D, device=device), k_cache, v_cache, slots), {}
    if op == "paged_attention":
        k_cache, v_cache, tables, seq_lens, qsl, q_len, ctx, _ = _paged(phase, device)
        return (_randn(t, HQ, D, device=device), k_cache, v_cache, tables, seq_lens, qsl, q_len, ctx, D ** -0.5), {}
    if op == "select_experts":
        return (_randn(t, E, device=device), TOPK, "softmax", False, 1, 1, True, 1.0, None, None), {}
    ids = torch.stack([torch.randperm(E, device=device)[:TOPK] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, TOPK, device=device)
    if op == "moe_experts":
        w13 = _randn(E, 2 * MOE_I, MOE_H, device=device, scale=MOE_H ** -0.5)
        w2 = _randn(E, MOE_H, MOE_I, device=device, scale=MOE_I ** -0.5)
        return (_randn(t, MOE_H, device=device), w13, w2, weights, ids), {}
    if op == "moe_experts_fp8":
        gen = torch.Generator().manual_seed(0)
        w13, w13s, w2, w2s = make_experts(E, MOE_H, MOE_I, gen, device)
        return (_randn(t, MOE_H, device=device), w13, w13s, w2, w2s, weights, ids), {}
    if op == "quantize_fp8":
        return (_randn(t, H, device=device), 128, None), {}
    if op in ("scaled_mm", "block_scaled_mm"):
        layout, group = ("row", 0) if op == "scaled_mm" else ("block", 128)
        w, ws = quantize_weight(_randn(I, H, device=device, dtype=torch.float32, scale=H ** -0.5), layout)
        xq, xs = quantize_fp8(_randn(t, H, device=device), group)
        return (xq, xs, w, ws, None, DTYPE), {}
    raise KeyError(op)
