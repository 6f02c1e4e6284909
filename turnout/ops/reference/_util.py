import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def randn(shape, dtype, device, gen, scale=1.0):
    # Generated on CPU so that every device sees the same numbers for a seed.
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def randint(low, high, shape, device, gen, dtype=torch.int64):
    return torch.randint(low, high, shape, generator=gen).to(device=device, dtype=dtype)
