"""RoPE on CPU with fewer temporaries: the rotated halves are written back in place."""

import torch

from turnout.ops.vendors.cpu.cache import reshape_and_cache
from turnout.ops.vendors.cpu.norm import rms_norm


def rotary_embedding(positions, query, key, cos_sin_cache, is_neox: bool) -> None:
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    cs = cos_sin_cache.index_select(0, positions.long())
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    for t in (query, key):
        if is_neox:
            x1, x2 = t[..., :half], t[..., half:rot]
        else:
            x1, x2 = t[..., 0:rot:2], t[..., 1:rot:2]
        if t.dtype == torch.float32:
            o1 = torch.addcmul(x1 * cos, x2, sin, value=-1.0)
            x2.copy_(torch.addcmul(x2 * cos, x1, sin))
            x1.copy_(o1)
        else:
            f1, f2 = x1.float(), x2.float()
            x1.copy_(f1 * cos - f2 * sin)
            x2.copy_(f2 * cos + f1 * sin)


def qk_norm_rotary(positions, query, key, q_weight, k_weight, eps: float, cos_sin_cache, is_neox: bool) -> None:
    """torch's rms_norm on each head, written back into the (fused qkv) views, then RoPE in place."""
    query.copy_(rms_norm(query, q_weight, eps))
    key.copy_(rms_norm(key, k_weight, eps))
    rotary_embedding(positions, query, key, cos_sin_cache, is_neox)


def qk_norm_rotary_cache(positions, query, key, value, q_weight, k_weight, eps: float, cos_sin_cache, is_neox: bool,
                         k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """The two CPU paths in a row: nothing to gain from one kernel here."""
    qk_norm_rotary(positions, query, key, q_weight, k_weight, eps, cos_sin_cache, is_neox)
    reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
