import torch

from turnout.ops.reference._util import randint, randn
from turnout.ops.reference.cache import reshape_and_cache
from turnout.ops.reference.norm import rms_norm
from turnout.ops.spec import OpSpec, SampleCase


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, H, rot_dim]; cos, sin: [T, 1, rot_dim // 2]
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """In place on query [T, Hq, D] and key [T, Hk, D] (token stride may exceed H*D).

    cos_sin_cache: [max_position, rot_dim] float32, cos in the first rot_dim/2 columns, sin in the
    rest. Only the first rot_dim dims of each head rotate (partial rotary). ``is_neox``: rotate halves
    (Llama/Qwen/NeoX); otherwise interleaved pairs (GPT-J). Computed in float32.
    """
    rot_dim = cos_sin_cache.shape[-1]
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, : rot_dim // 2], cs[:, None, rot_dim // 2:]
    for t in (query, key):
        r = t[..., :rot_dim]
        r.copy_(_rotate(r.float(), cos, sin, is_neox).to(t.dtype))


def qk_norm_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """The attention prologue of models with q/k norm (Qwen3, GLM-4 MoE), in place on query [T, Hq, D] and
    key [T, Hk, D] (strided views of a fused qkv allowed): RMSNorm over each head with q_weight /
    k_weight [D], then RoPE. Exactly ``rms_norm`` on each, then ``rotary_embedding``."""
    query.copy_(rms_norm(query, q_weight, eps))
    key.copy_(rms_norm(key, k_weight, eps))
    rotary_embedding(positions, query, key, cos_sin_cache, is_neox)


def qk_norm_rotary_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor,
                         is_neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> None:
    """``qk_norm_rotary`` then ``reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)``: the whole
    attention prologue of a q/k-norm model before paged attention (value [T, Hk, D] may be a strided view of
    the fused qkv; slot -1 is padding and writes nothing). k_scale / v_scale: an fp8 cache's (reshape_and_cache)."""
    qk_norm_rotary(positions, query, key, q_weight, k_weight, eps, cos_sin_cache, is_neox)
    reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def make_cos_sin_cache(rot_dim: int, max_position: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, rot_dim]


def _samples(device, dtype, gen):
    for t, hq, hk, d, rot, neox in [(1, 4, 2, 64, 64, True), (7, 8, 2, 64, 64, False), (13, 4, 4, 128, 64, True),
                                    (5, 6, 2, 32, 16, False)]:
        cache = make_cos_sin_cache(rot, 4096).to(device)
        # q and k as views into one fused qkv tensor, as the model produces them.
        qkv = randn((t, (hq + 2 * hk) * d), dtype, device, gen)
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
        pos = randint(0, 4096, (t,), device, gen)
        yield SampleCase(f"T{t}-Hq{hq}-Hk{hk}-D{d}-rot{rot}-{'neox' if neox else 'gptj'}", (pos, q, k, cache, neox))


ROTARY_EMBEDDING = OpSpec(
    "rotary_embedding", rotary_embedding, _samples, mutates=("query", "key"),
    tolerance={"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)},
    doc="RoPE in place on q and k (neox or gptj style, partial rotary)")


def _qk_norm_samples(device, dtype, gen):
    for case in _samples(device, dtype, gen):
        pos, q, k, cache, neox = case.args
        d = q.shape[-1]
        qw = randn((d,), dtype, device, gen, 0.5) + 1
        kw = randn((d,), dtype, device, gen, 0.5) + 1
        yield SampleCase(case.label, (pos, q, k, qw, kw, 1e-6, cache, neox))


QK_NORM_ROTARY = OpSpec(
    "qk_norm_rotary", qk_norm_rotary, _qk_norm_samples, mutates=("query", "key"),
    tolerance={"float32": (1e-5, 1e-5), "float16": (1e-2, 1e-2), "bfloat16": (6e-2, 2e-2)},
    doc="per-head RMSNorm of q and k, then RoPE, in place (q/k-norm models)")


def _qk_norm_cache_samples(device, dtype, gen):
    for i, case in enumerate(_qk_norm_samples(device, dtype, gen)):
        pos, q, k, qw, kw, eps, cache, neox = case.args
        t, hk, d = k.shape
        hq = q.shape[1]
        # value: the third view of the same fused qkv (strided), as the model passes it
        base = q.as_strided((t, (hq + 2 * hk) * d), (q.stride(0), 1))
        v = base[:, (hq + hk) * d:].view(t, hk, d)
        nb, bs = 8, (16, 8, 4, 16)[i % 4]
        kc, vc = randn((nb, bs, hk, d), dtype, device, gen), randn((nb, bs, hk, d), dtype, device, gen)
        slots = torch.randperm(nb * bs, generator=gen)[:t]
        slots[torch.rand(t, generator=gen) < 0.2] = -1  # padding lanes
        yield SampleCase(case.label + f"-BS{bs}", (pos, q, k, v, qw, kw, eps, cache, neox, kc, vc, slots.to(device)))


QK_NORM_ROTARY_CACHE = OpSpec(
    "qk_norm_rotary_cache", qk_norm_rotary_cache, _qk_norm_cache_samples,
    mutates=("query", "key", "k_cache", "v_cache"),
    tolerance={"float32": (1e-5, 1e-5), "float16": (1e-2, 1e-2), "bfloat16": (6e-2, 2e-2)},
    doc="qk_norm_rotary, then the new k and v written into the paged KV cache (one launch on GPUs)")
