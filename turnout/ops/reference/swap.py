"""Per-layer KV swap ops: the copies between the device cache and the host tier (turnout/kv/tiers.py).

Three levels, tried in this order by the engine (turnout/worker/kv_transfer.py), each an op of its own so
that a platform missing one keeps the others (one op for all three would be disabled whole by one missing
vendor op):

- ``swap_layer_async``: one layer's k and v blocks copied on a side stream; returns the event recorded
  after the copies, which the forward waits on just before that layer (so layer i+1's copy overlaps
  layer i's compute). Needs device streams: on a platform without them every implementation is
  unavailable, with that reason (``OpSpec.requires``).
- ``swap_layer``: one layer's k and v blocks, in line on the current stream (no overlap).
- ``swap_blocks`` (reference/cache.py): one tensor, the whole-cache fallback (every layer before the step).

The ops are ``optional``: a platform with none of them still starts (recompute preemption, no host tier).
"""

import torch

from turnout.ops.reference._util import randn
from turnout.ops.reference.cache import _mapping
from turnout.ops.spec import OpSpec, SampleCase


def swap_layer(src: list[torch.Tensor], dst: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """For each pair (src[i], dst[i]) of one layer's caches ([k, v], [num_blocks, ...], the two sides may
    be on different devices) and each row (s, d) of block_mapping [N, 2] i64: dst[i][d] = src[i][s].
    Ordered on the current stream: work queued after it sees the blocks."""
    if block_mapping.numel() == 0:
        return
    m = block_mapping.to("cpu").long()
    for s, d in zip(src, dst):
        d[m[:, 1].to(d.device)] = s[m[:, 0].to(s.device)].to(d.device)


def swap_layer_async(src: list[torch.Tensor], dst: list[torch.Tensor], block_mapping: torch.Tensor,
                     stream=None):
    """``swap_layer`` queued on ``stream`` (None: the current stream) after the work already on it;
    returns the event recorded on that stream after the copies (the consumer waits on it)."""
    dev = next((t.device for t in list(src) + list(dst) if t.device.type != "cpu"), None)
    mod = getattr(torch, dev.type)  # the device module (torch.cuda, ...); requires() checked it has streams
    stream = stream or mod.current_stream(dev)
    with mod.stream(stream):
        swap_layer(src, dst, block_mapping)
        event = mod.Event()
        event.record(stream)
    return event


def has_streams(platform) -> tuple[bool, str]:
    """Whether the platform's device has streams and events, which the async copy needs."""
    mod = getattr(torch, platform.device_type, None)
    if not platform.is_gpu or mod is None:
        return False, (f"platform {platform.name} has no device streams (its copies run in line with "
                       "compute, so there is nothing to overlap)")
    missing = [n for n in ("Stream", "Event", "stream", "current_stream") if not hasattr(mod, n)]
    if missing:
        return False, f"torch.{platform.device_type} has no {', '.join(missing)}"
    return True, "available"


def _layer_samples(device, dtype, gen):
    for nb, n in [(8, 1), (16, 6)]:
        src = [randn((nb, 16, 2, 32), dtype, device, gen) for _ in range(2)]
        dst = [randn((nb, 16, 2, 32), dtype, "cpu", gen) for _ in range(2)]  # device -> host: a swap-out
        yield SampleCase(f"to-host-NB{nb}-N{n}", (src, dst, _mapping(nb, n, gen)))
        back = [randn((nb, 16, 2, 32), dtype, "cpu", gen) for _ in range(2)]
        into = [randn((nb, 16, 2, 32), dtype, device, gen) for _ in range(2)]  # host -> device: a swap-in
        yield SampleCase(f"to-device-NB{nb}-N{n}", (back, into, _mapping(nb, n, gen)))


def _async_samples(device, dtype, gen):
    if torch.device(device).type == "cpu":
        return  # no streams: requires() makes every implementation unavailable here
    yield from _layer_samples(device, dtype, gen)


_EXACT = {"float32": (0.0, 0.0), "float16": (0.0, 0.0), "bfloat16": (0.0, 0.0)}

SWAP_LAYER = OpSpec("swap_layer", swap_layer, _layer_samples, mutates=("dst",), tolerance=_EXACT, optional=True,
                    doc="copy one layer's k/v blocks between the device cache and the host tier, in line")
SWAP_LAYER_ASYNC = OpSpec("swap_layer_async", swap_layer_async, _async_samples, mutates=("dst",), tolerance=_EXACT,
                          optional=True, requires=has_streams,
                          doc="copy one layer's k/v blocks on a side stream; returns the event to wait on")
