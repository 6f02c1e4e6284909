"""Grammar-constrained decoding: a packed token bitmask applied to the logits before sampling.

Bit ``j % 32`` of word ``j // 32`` in a row says whether token ``j`` is allowed (1) or not (0), the layout
xgrammar's ``GrammarMatcher.fill_next_token_bitmask`` writes (int32 words, the sign bit is token 31 of
the word). Disallowed logits become -inf; allowed ones are left exactly as they were.
"""

import torch

from turnout.ops.reference._util import randint, randn
from turnout.ops.spec import OpSpec, SampleCase


def check_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor, indices) -> None:
    """The shape rules every implementation enforces (a wrong mask width would silently leave tokens open)."""
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"apply_token_bitmask: logits and bitmask must be 2-D, got {tuple(logits.shape)} "
                         f"and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"apply_token_bitmask: bitmask must be int32, got {bitmask.dtype}")
    words = (logits.shape[1] + 31) // 32
    if bitmask.shape[1] < words:
        raise ValueError(f"apply_token_bitmask: bitmask has {bitmask.shape[1]} words a row, logits' "
                         f"{logits.shape[1]} tokens need {words}")
    if indices is None and bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"apply_token_bitmask: {bitmask.shape[0]} bitmask rows for {logits.shape[0]} logits "
                         "rows (pass indices to mask only some rows)")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None) -> None:
    """logits [B, V] (float32; any float dtype works), bitmask [B, >= ceil(V/32)] int32, indices [B'] int
    or None -> None; in place: ``logits[r, j] = -inf`` where bit j of ``bitmask[r]`` is 0, for every row r
    in ``indices`` (all rows when None). A row index names the same row of logits and bitmask (xgrammar's
    convention), so unconstrained rows of a mixed batch are simply left out of ``indices``. Words beyond
    ceil(V/32) and bits beyond V are ignored: a mask allocated for a wider vocabulary still applies.
    """
    check_bitmask_args(logits, bitmask, indices)
    v = logits.shape[1]
    rows = torch.arange(logits.shape[0], device=logits.device) if indices is None else indices.long()
    if rows.numel() == 0 or v == 0:
        return
    words = bitmask[rows, : (v + 31) // 32].long()  # [B', W]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int64)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(rows.numel(), -1)[:, :v].bool()  # [B', V]
    sub = logits[rows]
    logits[rows] = sub.masked_fill(~allowed, float("-inf"))


def random_bitmask(rows: int, vocab: int, words: int, gen, p_allowed: float) -> torch.Tensor:
    """[rows, words] int32: each of the first ``vocab`` bits set with probability p_allowed, later bits random
    (they must be ignored)."""
    bits = torch.rand((rows, words * 32), generator=gen) < p_allowed
    junk = torch.rand((rows, words * 32), generator=gen) < 0.5
    bits[:, vocab:] = junk[:, vocab:]
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
    packed = (bits.view(rows, words, 32).long() * weights).sum(-1)  # [rows, words] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _samples(device, dtype, gen):
    # (rows, vocab V of the logits, words a row, allowed fraction)
    for b, v, w, p in [(1, 64, 2, 0.5), (3, 50, 2, 0.3), (4, 1000, 32, 0.1), (2, 5003, 157, 0.02)]:
        logits = randn((b, v), dtype, device, gen, 3.0)
        yield SampleCase(f"B{b}-V{v}-p{p}", (logits, random_bitmask(b, v, w, gen, p).to(device), None))
    # every token allowed in one row, none in another (the sampler must then see all -inf), one row of
    # each sign pattern of the top bit
    logits = randn((3, 100), dtype, device, gen, 3.0)
    mask = torch.stack([torch.full((4,), -1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                        torch.tensor([-2**31, 1, 2**31 - 1, 3], dtype=torch.int32)])
    yield SampleCase("all-none-signbits", (logits, mask.to(device), None))
    # a mixed batch: only rows 0, 2 and 5 are constrained; the others' mask rows hold garbage
    logits = randn((6, 777), dtype, device, gen, 3.0)
    mask = random_bitmask(6, 777, 25, gen, 0.2).to(device)
    yield SampleCase("indices", (logits, mask, torch.tensor([0, 2, 5], dtype=torch.int32, device=device)))
    yield SampleCase("indices-empty", (randn((2, 40), dtype, device, gen), random_bitmask(2, 40, 2, gen, 0.5).to(device),
                                       torch.zeros(0, dtype=torch.int64, device=device)))
    # vocabulary padding: the LM head's V (4160) exceeds the tokenizer's 4100 tokens; the mask, built
    # for V, leaves the padding tokens off; the mask is also one word wider than V needs
    logits = randn((2, 4160), dtype, device, gen, 3.0)
    mask = random_bitmask(2, 4100, 131, gen, 0.5)
    mask[:, 4100 // 32] &= (1 << (4100 % 32)) - 1
    mask[:, 4100 // 32 + 1:] = 0
    idx = randint(0, 2, (1,), device, gen)
    yield SampleCase("vocab-padding", (logits, mask.to(device), idx))


def _compare(ref: list, got: list, case) -> tuple[bool, float, str]:
    """Bit-exact: masked logits are -inf in both, the others untouched. (The default tolerance test cannot
    see a finite logit where the reference has -inf: its bound is rtol * inf = NaN.)"""
    if len(ref) != len(got):
        return False, float("inf"), f"{len(got)} outputs, expected {len(ref)}"
    for n, (r, g) in enumerate(zip(ref, got)):
        r, g = r.cpu(), g.cpu()
        if r.shape != g.shape:
            return False, float("inf"), f"output {n}: shape {tuple(g.shape)}, expected {tuple(r.shape)}"
        differ = ~((r == g) | (torch.isnan(r) & torch.isnan(g)))
        if differ.any():
            rows, cols = differ.nonzero(as_tuple=True)
            wrong_inf = (torch.isinf(r) != torch.isinf(g))[differ].sum().item()
            return False, float("inf"), (f"output {n}: {int(differ.sum())} elements differ ({wrong_inf} masked where "
                                         f"the reference is not or the reverse), first at "
                                         f"[{rows[0].item()}, {cols[0].item()}]: {g[rows[0], cols[0]].item()} "
                                         f"vs {r[rows[0], cols[0]].item()}")
    return True, 0.0, ""


APPLY_TOKEN_BITMASK = OpSpec(
    "apply_token_bitmask", apply_token_bitmask, _samples, mutates=("logits",),
    tolerance={"float32": (0.0, 0.0), "float16": (0.0, 0.0), "bfloat16": (0.0, 0.0)}, compare=_compare,
    doc="structured output: logits of tokens whose bit is 0 in the packed int32 bitmask become -inf")
