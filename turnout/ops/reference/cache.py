import torch

from turnout.ops.kv_cache import FP8_KV, FP8_KV_MAX
from turnout.ops.reference._util import randn
from turnout.ops.spec import OpSpec, SampleCase


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Values as the cache stores them: a cast, or for an fp8 cache (turnout/ops/kv_cache.py) x / scale in
    float32 (scale [1] f32, None: 1), clamped to e4m3's +-448 and rounded to nearest even."""
    if cache_dtype != FP8_KV:
        return x.to(cache_dtype)
    y = x.float() if scale is None else x.float() / scale.float()
    return y.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV)


def from_cache(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache values in float32: an fp8 cache's times its scale (None: 1)."""
    y = x.float()
    return y if x.dtype != FP8_KV or scale is None else y * scale.float()


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Write key/value [T, Hk, D] into the paged caches [num_blocks, block_size, Hk, D] at
    slot_mapping [T] (slot = block * block_size + offset). Slot -1 means skip (padding).
    An fp8 cache stores ``to_cache(key, fp8, k_scale)`` (k_scale / v_scale: [1] float32)."""
    nb, bs = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(nb * bs, *k_cache.shape[2:])[slots] = to_cache(key[keep], k_cache.dtype, k_scale)
    v_cache.view(nb * bs, *v_cache.shape[2:])[slots] = to_cache(value[keep], v_cache.dtype, v_scale)


def copy_blocks(caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """For each cache tensor [num_blocks, ...] and each row (src, dst) of block_mapping [N, 2]:
    cache[dst] = cache[src]. Used for copy-on-write of shared blocks."""
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for c in caches:
        c[dst.to(c.device)] = c[src.to(c.device)]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """dst[m[:, 1]] = src[m[:, 0]] for block_mapping m [N, 2]; src and dst may be on different devices
    (GPU <-> CPU KV tiers)."""
    if block_mapping.numel() == 0:
        return
    m = block_mapping.to("cpu").long()
    picked = src[m[:, 0].to(src.device)]
    dst[m[:, 1].to(dst.device)] = picked.to(dst.device)


def _cache(nb, bs, hk, d, dtype, device, gen):
    return randn((nb, bs, hk, d), dtype, device, gen), randn((nb, bs, hk, d), dtype, device, gen)


def _rc_samples(device, dtype, gen):
    for t, nb, bs, hk, d in [(1, 4, 16, 2, 64), (20, 8, 16, 4, 32), (37, 16, 8, 1, 128)]:
        kc, vc = _cache(nb, bs, hk, d, dtype, device, gen)
        slots = torch.randperm(nb * bs, generator=gen)[:t]
        slots[torch.rand(t, generator=gen) < 0.2] = -1  # padding lanes
        yield SampleCase(f"T{t}-NB{nb}-BS{bs}-Hk{hk}-D{d}",
                         (randn((t, hk, d), dtype, device, gen), randn((t, hk, d), dtype, device, gen), kc, vc,
                          slots.to(device)))


def _mapping(nb, n, gen):
    perm = torch.randperm(nb, generator=gen)
    return torch.stack([perm[:n], perm[n: 2 * n]], dim=1)  # distinct src and dst blocks


def _copy_samples(device, dtype, gen):
    for nb, n, layers in [(8, 1, 1), (16, 5, 3)]:
        caches = [randn((nb, 16, 2, 32), dtype, device, gen) for _ in range(2 * layers)]
        yield SampleCase(f"NB{nb}-N{n}-L{layers}", (caches, _mapping(nb, n, gen).to(device)))


def _swap_samples(device, dtype, gen):
    for nb, n in [(8, 1), (16, 6)]:
        src = randn((nb, 16, 2, 32), dtype, device, gen)
        dst = randn((nb, 16, 2, 32), dtype, "cpu", gen)  # device -> host, as swap-out does
        yield SampleCase(f"to-cpu-NB{nb}-N{n}", (src, dst, _mapping(nb, n, gen)))
        yield SampleCase(f"same-device-NB{nb}-N{n}", (randn((nb, 16, 2, 32), dtype, device, gen),
                                                       randn((nb, 16, 2, 32), dtype, device, gen),
                                                       _mapping(nb, n, gen)))


_EXACT = {"float32": (0.0, 0.0), "float16": (0.0, 0.0), "bfloat16": (0.0, 0.0)}

RESHAPE_AND_CACHE = OpSpec("reshape_and_cache", reshape_and_cache, _rc_samples, mutates=("k_cache", "v_cache"),
                           tolerance=_EXACT, doc="write K/V into the paged cache by slot mapping; -1 skips")
COPY_BLOCKS = OpSpec("copy_blocks", copy_blocks, _copy_samples, mutates=("caches",), tolerance=_EXACT,
                     doc="copy whole KV blocks within each cache by a (src, dst) mapping")
SWAP_BLOCKS = OpSpec("swap_blocks", swap_blocks, _swap_samples, mutates=("dst",), tolerance=_EXACT, optional=True,
                     doc="copy KV blocks between two caches (GPU <-> CPU) by a (src, dst) mapping")
