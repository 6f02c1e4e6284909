import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def randn(shape, dtype, device, gen, scale=1.0):
    # Generated on CPU so that every device sees the same numbers for a seed.
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def randint(low, high, shape, device, gen, dtype=torch.int64):
    return torch.randint(low, high, shape, generator=gen).to(device=device, dtype=dtype)


def compare_tensors(ref: list, got: list, atol: float, rtol: float) -> tuple[bool, float, str]:
    if len(ref) != len(got):
        return False, float("inf"), f"{len(got)} outputs, expected {len(ref)}"
    worst = 0.0
    for n, (r, g) in enumerate(zip(ref, got)):
        if r.shape != g.shape:
            return False, float("inf"), f"output {n}: shape {tuple(g.shape)}, expected {tuple(r.shape)}"
        r, g = r.cpu(), g.cpu()
        if not r.is_floating_point():
            bad = (r != g).sum().item()
            if bad:
                return False, float(bad), f"output {n}: {bad} of {r.numel()} integer elements differ"
            continue
        r, g = r.float(), g.float()
        if torch.isnan(g).any() and not torch.isnan(r).any():
            return False, float("nan"), f"output {n}: NaN where the reference has numbers (unwritten elements?)"
        err = (r - g).abs()
        worst = max(worst, err.max().item() if err.numel() else 0.0)
        bound = atol + rtol * r.abs()
        if (err > bound).any():
            return False, worst, f"output {n}: max error {worst:.3g} beyond atol={atol} rtol={rtol}"
    return True, worst, ""
