"""One layer's KV block swap through the Triton block-copy kernels (cache.py: gather where the blocks are,
one copy across, scatter)."""

from turnout.ops.triton.cache import swap_blocks


def swap_layer(src, dst, block_mapping) -> None:
    for s, d in zip(src, dst):
        swap_blocks(s, d, block_mapping)
