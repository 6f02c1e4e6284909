"""KV block swaps between a GPU cache and pinned host blocks: one ``copy_(non_blocking=True)`` per run of
consecutive blocks (a DMA each, as cudaMemcpyAsync per block pair does in vLLM's swap_blocks), queued on
the current stream or the given one. No staging buffer and no host sync, so a swap-out queued before a
step's forward reads the blocks before that forward can overwrite them, and a swap-in on a side stream
overlaps the forward of the layers before it."""

import torch


def _runs(mapping: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs of consecutive pairs in a [N, 2] mapping."""
    pairs = mapping.to("cpu").tolist()
    runs = []
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def swap_layer(src, dst, block_mapping) -> None:
    if block_mapping.numel() == 0:
        return
    runs = _runs(block_mapping)
    for s, d in zip(src, dst):
        for a, b, n in runs:
            d[b:b + n].copy_(s[a:a + n], non_blocking=True)


def swap_layer_async(src, dst, block_mapping, stream=None):
    dev = next(t.device for t in list(src) + list(dst) if t.device.type != "cpu")
    stream = stream or torch.cuda.current_stream(dev)
    with torch.cuda.stream(stream):
        swap_layer(src, dst, block_mapping)
        event = torch.cuda.Event()
        event.record(stream)
    return event
