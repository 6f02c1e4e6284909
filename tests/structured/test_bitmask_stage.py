"""BitmaskStage (the sampler's grammar stage): masked logits equal the per-row reference, unconstrained
lanes untouched, a faulty state fails its lane alone, threaded and row-by-row fills agree, and on a GPU
the pinned double buffer survives back-to-back steps."""

from __future__ import annotations

import pytest
import torch

from turnout.ops import resolve
from turnout.platforms import detect_platform
from turnout.structured import StructuredOutputsParams
from turnout.structured.mask import BitmaskStage
from turnout.structured.matcher import allocate_bitmask

DEV = "cuda" if torch.cuda.is_available() else "cpu"


class Broken:
    def fill_bitmask(self, bitmask, row=0):
        raise RuntimeError("grammar state lost")

    def is_terminated(self):
        return False


def _expected(logits, states, compiler):
    want = logits.clone().cpu()
    for lane, state in states:
        m = allocate_bitmask(1, compiler.vocab_size)
        state.fill_bitmask(m, 0)
        bits = ((m[0].long()[:, None] >> torch.arange(32)) & 1).flatten()[: logits.shape[1]].bool()
        want[lane] = want[lane].masked_fill(~bits, float("-inf"))
    return want


@pytest.mark.parametrize("threads", [None, 2], ids=["row-by-row", "threaded"])
def test_stage_masks_the_constrained_lanes_only(tok, compiler, threads):
    table = resolve(detect_platform(), ops=["apply_token_bitmask"])
    stage = BitmaskStage(compiler.vocab_size, max_rows=4, device=DEV, threads=threads, parallel_from=2)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    g = torch.Generator().manual_seed(0)
    # Step 1 grows the buffers (5 rows); step 3 reuses step 1's buffer with other lanes, whose stale rows
    # must not leak into it.
    for step in range(4):
        a = compiler.new_state(StructuredOutputsParams(json=schema))
        b = compiler.new_state(StructuredOutputsParams(regex="[0-9]+"))
        b.accept_tokens(tok.encode("1" * step, add_special_tokens=False))
        c = compiler.new_state(StructuredOutputsParams(choice=["yes", "no"]))
        grammars = {0: [(0, a), (2, b), (3, c)], 1: [(1, a), (2, Broken()), (4, c)], 2: [(0, a), (3, c)],
                    3: [(0, a), (2, b)]}[step]
        rows = 4 if step == 0 else 5
        logits = torch.randn(rows, compiler.vocab_size, generator=g).to(DEV)
        good = [(lane, s) for lane, s in grammars if not isinstance(s, Broken)]
        want = _expected(logits, good, compiler)
        faults = stage.apply(table, logits, grammars)
        assert set(faults) == ({2} if step == 1 else set())
        got = logits.cpu()
        assert torch.equal(got, want)
        free = [r for r in range(rows) if r not in {lane for lane, _ in grammars}]
        assert not torch.isinf(got[free]).any()


def test_stage_refuses_wider_logits(compiler):
    stage = BitmaskStage(compiler.vocab_size, max_rows=1, threads=None)
    table = resolve(detect_platform(), ops=["apply_token_bitmask"])
    with pytest.raises(ValueError, match="vocabulary"):
        stage.apply(table, torch.zeros(1, compiler.vocab_size + 64), [(0, Broken())])


class Scripted:
    """A grammar state that writes a given mask row (no xgrammar needed)."""

    def __init__(self, row: torch.Tensor):
        self.row = row

    def fill_bitmask(self, bitmask, row=0):
        bitmask[row] = self.row
        return True

    def is_terminated(self):
        return False


@pytest.mark.parametrize("vocab", [1000, 151936])
def test_back_to_back_steps_never_read_a_rewritten_buffer(vocab):
    # Many steps queued without a sync, each behind a busy stream: every step's rows differ, so a copy
    # that read a buffer a later step had already refilled would mask with the wrong rows.
    from turnout.ops.reference.bitmask import apply_token_bitmask, random_bitmask

    table = resolve(detect_platform(), ops=["apply_token_bitmask"])
    stage = BitmaskStage(vocab, max_rows=8, device=DEV, threads=None)
    g = torch.Generator().manual_seed(1)
    words = (vocab + 31) // 32
    steps = []
    for step in range(12 if DEV == "cuda" else 3):  # made first: the loop below must outrun the device
        masks = random_bitmask(8, vocab, words, g, 0.5)
        lanes = [i for i in range(8) if (i + step) % 3]
        logits = torch.randn(8, vocab, generator=g)
        want = logits.clone()
        full = torch.full_like(masks, -1)
        full[lanes] = masks[lanes]
        apply_token_bitmask(want, full)
        steps.append((logits.to(DEV), [(i, Scripted(masks[i])) for i in lanes], want))
    if DEV == "cuda":
        torch.cuda.synchronize()
    for dev, grammars, _ in steps:
        if DEV == "cuda":
            torch.cuda._sleep(20_000_000)  # hold the stream: the host runs steps ahead of the copies
        assert not stage.apply(table, dev, grammars)
    outs, wants = [d for d, _, _ in steps], [w for _, _, w in steps]
    for got, want in zip(outs, wants):
        assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_stage_on_gpu_uses_pinned_buffers():
    stage = BitmaskStage(1000, max_rows=2, device="cuda", threads=None)
    assert all(b.is_pinned() for b in stage._host)
