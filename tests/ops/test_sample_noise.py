"""Regression: the hashed uniform noise must stay strictly below 1.

With 24 bits, the top hash value rounded to u = 1.0 in float32, so E = -log(u) = -0.0 and a token masked
out by top-k / top-p (p = 0) got p / E = NaN, which argmax then picked: about one row in a hundred at a
150k vocabulary drew a token the filters had removed (found on the H200 by the full-vocab kernel test).
"""

import torch

from turnout.ops.reference import sampling as ref


def test_noise_is_strictly_inside_0_1_at_the_extremes():
    h = torch.tensor([0, 2**32 - 1], dtype=torch.int64)
    u = ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)  # the formula uniform_noise uses
    assert 0.0 < u[0] and u[1] < 1.0
    assert (-torch.log(u) > 0).all()


def test_filtered_tokens_are_never_drawn_at_full_vocab():
    g = torch.Generator().manual_seed(0)
    b, v = 64, 151936
    logits = torch.randn((b, v), generator=g) * 4
    logits[::5] = logits[::5].bfloat16().float()
    args = (logits, torch.rand(b, generator=g) * 1.5, torch.randint(0, 100, (b,), generator=g).int(),
            torch.rand(b, generator=g).clamp_min(0.3), torch.rand(b, generator=g) * 0.1,
            torch.randint(0, 2**62, (b,), generator=g), torch.randint(0, 4096, (b,), generator=g))
    args[1][::4] = 0.0
    tokens = ref.sample(*args)
    u = ref.uniform_noise(args[5], args[6], v)
    assert (u < 1).all() and (u > 0).all()
    # every drawn token survives its own top-k (the loosest filter that applies to every sampled row)
    k = args[2].long()
    rank = (logits > logits.gather(1, tokens[:, None])).sum(-1)
    sampled = args[1] > 0
    limit = torch.where(k > 0, k, torch.full_like(k, v))
    assert (rank[sampled] < limit[sampled]).all()
