"""sample on CPU: greedy rows by argmax alone; only the other rows pay for the full filter + noise."""

import torch

from turnout.ops.reference.sampling import sample as reference_sample


def sample(logits, temperature, top_k, top_p, min_p, seeds, steps):
    out = logits.argmax(-1)
    rows = (temperature != 0).nonzero()[:, 0]
    if rows.numel():
        out[rows] = reference_sample(logits[rows], temperature[rows], top_k[rows], top_p[rows], min_p[rows],
                                     seeds[rows], steps[rows])
    return out
