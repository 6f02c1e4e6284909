"""KV block swaps on CPU: index_select + index_copy_ (no advanced-indexing temporaries)."""

import torch


def swap_layer(src, dst, block_mapping) -> None:
    if block_mapping.numel() == 0:
        return
    m = block_mapping.long()
    s_idx, d_idx = m[:, 0].contiguous(), m[:, 1].contiguous()
    for s, d in zip(src, dst):
        if s.dtype == d.dtype == torch.float8_e4m3fn:  # an fp8 KV cache: bytes (no fp8 index_copy_ on CPU)
            s, d = s.view(torch.uint8), d.view(torch.uint8)
        d.index_copy_(0, d_idx, torch.index_select(s, 0, s_idx).to(d.dtype))
