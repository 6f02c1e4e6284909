"""Cache groups other than k/v: a latent group (one vector per token, kv/spec.py ``LatentSpec``) and a state
group (a fixed-size state per request, ``StateSpec``), declared by test layers beside a real attention layer,
allocated by the runner's own functions (worker/kv_sizing.py), swapped out and back in through the runner's
KV tiers (worker/kv_transfer.py, the CPU op table's swap ops) as the block manager queues the copies, and freed.
The bytes are checked after a round trip during which their device blocks and slot were given to another
sequence and overwritten."""

import pytest
import torch
from torch import nn

from turnout.config import EngineConfig
from turnout.engine.sequence import Sequence
from turnout.kv.block_manager import BlockManager
from turnout.kv.spec import FullAttentionSpec, LatentSpec, StateSpec
from turnout.layers.attention import Attention
from turnout.ops import Policy, resolve
from turnout.platforms import detect_platform
from turnout.worker.kv_sizing import allocate_caches, model_cache_layout
from turnout.worker.kv_transfer import KVTransfer

BS = 4


class LatentLayer(nn.Module):
    """Stands in for multi-head latent attention: what it stores per token."""

    def kv_spec(self, cache_dtype: str):
        return LatentSpec(kv_lora_rank=12, rope_dim=4, dtype=cache_dtype)


class StateLayer(nn.Module):
    """Stands in for a recurrent layer: a convolution window and an SSM state per request."""

    def kv_spec(self, cache_dtype: str):
        return StateSpec(shapes=((3, 8), (2, 4, 4)), dtypes=("float32", "float32"))


class TinyHybrid(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.layers = nn.ModuleList([Attention(4, 2, 8, 8 ** -0.5, ops), LatentLayer(), StateLayer(), LatentLayer()])


class Rank:
    """What KVTransfer reads of a model runner: its cache layout, tensors and op table."""

    def __init__(self, ops, layout, num_blocks, num_state_slots):
        self.ops, self.platform, self.device = ops, detect_platform("cpu"), torch.device("cpu")
        self.cache_layout, self.block_size = layout, BS
        self.num_blocks, self.num_state_slots = num_blocks, num_state_slots
        self.kv_caches = allocate_caches(layout, num_blocks, BS, num_state_slots, self.device)
        self.block_bytes = layout.block_bytes(BS)


@pytest.fixture
def rank():
    ops = resolve(detect_platform("cpu"), Policy())
    layout = model_cache_layout(TinyHybrid(ops), torch.float32)
    return Rank(ops, layout, num_blocks=16, num_state_slots=3)


def _fill(r, seq, bm, gen):
    """Random values in every tensor of seq's blocks and state slot; returns them per layer."""
    slot = bm.states.slot_of[seq.seq_id]
    blocks = torch.tensor(seq.block_table)
    vals = []
    for spec, tensors in zip(r.cache_layout.specs, r.kv_caches):
        idx = blocks if spec.per_token else torch.tensor([slot])
        got = []
        for t in tensors:
            t[idx] = torch.randn(t[idx].shape, generator=gen)
            got.append(t[idx].clone())
        vals.append(got)
    return vals


def _read(r, seq, bm):
    slot = bm.states.slot_of[seq.seq_id]
    blocks = torch.tensor(seq.block_table)
    return [[t[blocks if spec.per_token else torch.tensor([slot])].clone() for t in tensors]
            for spec, tensors in zip(r.cache_layout.specs, r.kv_caches)]


def test_layers_declare_their_groups_and_the_runner_allocates_them(rank):
    lay = rank.cache_layout
    assert lay.specs[0] == FullAttentionSpec(2, 8, "float32") and lay.specs[1] == lay.specs[3]
    assert [g.layers for g in lay.groups] == [(0,), (1, 3), (2,)]
    shapes = [[tuple(t.shape) for t in layer] for layer in rank.kv_caches]
    assert shapes == [[(16, BS, 2, 8), (16, BS, 2, 8)], [(16, BS, 16)], [(3, 3, 8), (3, 2, 4, 4)], [(16, BS, 16)]]
    assert rank.block_bytes == BS * 4 * (2 * 2 * 8 + 16 + 16)
    assert lay.state_bytes == 4 * (24 + 32)


def test_latent_and_state_groups_swap_out_and_back_in_and_free(rank):
    rank = Rank(rank.ops, rank.cache_layout, num_blocks=6, num_state_slots=2)  # small: c must take a's blocks
    cfg = EngineConfig(preemption_mode="swap", swap_space=8 * rank.block_bytes / 2**30, enable_prefix_caching=False)
    xfer = KVTransfer(rank, cfg)
    assert xfer.num_swap_blocks == 8 and xfer.num_host_state_slots == 2
    assert [tuple(t.shape) for t in xfer.host_caches[2]] == [(2, 3, 8), (2, 2, 4, 4)]  # host state slots
    bm = BlockManager(6, BS, False, swap_blocks=xfer.num_swap_blocks, state_slots=rank.num_state_slots,
                      state_swap_slots=xfer.num_host_state_slots)
    gen = torch.Generator().manual_seed(0)
    a, b = Sequence(0, "a", list(range(10)), None, 0), Sequence(1, "b", list(range(6)), None, 0)
    for s in (a, b):
        bm.allocate(s)
        s.num_computed_tokens = s.num_tokens
    assert bm.states.slot_of == {0: 0, 1: 1}
    want_a, want_b = _fill(rank, a, bm, gen), _fill(rank, b, bm, gen)

    assert bm.swap_out(a)
    out, _ = bm.take_transfers()
    state_out, _ = bm.states.take_transfers()
    assert len(out) == 3 and len(state_out) == 1
    xfer.swap_out(out)
    xfer.swap_states(state_out, to_host=True)
    # a's device blocks and slot go to c, which overwrites them
    c = Sequence(2, "c", list(range(12)), None, 0)
    bm.allocate(c)
    assert len(set(c.block_table) & {d for d, _ in out}) == 2 and bm.states.slot_of[2] == state_out[0][0]
    _fill(rank, c, bm, gen)
    bm.free(c)

    assert bm.can_swap_in(a, 1)
    bm.swap_in(a)
    _, into = bm.take_transfers()
    _, state_in = bm.states.take_transfers()
    gate = xfer.swap_in(into)
    if gate is not None:
        gate.finish()
    xfer.swap_states(state_in, to_host=False)
    for got, want in zip(_read(rank, a, bm), want_a):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    for got, want in zip(_read(rank, b, bm), want_b):
        assert all(torch.equal(g, w) for g, w in zip(got, want))

    for s in (a, b):
        bm.free(s)
    assert bm.num_free_blocks == 6 and bm.states.num_free == 2 and bm.swap_pool.num_free == 8


def test_each_sequence_needs_a_state_slot(rank):
    bm = BlockManager(16, BS, state_slots=2)
    seqs = [Sequence(i, f"r{i}", [1, 2, 3], None, 0) for i in range(3)]
    bm.allocate(seqs[0])
    bm.allocate(seqs[1])
    assert bm.num_free_blocks == 14 and not bm.can_allocate(seqs[2])  # blocks free, slots not
    with pytest.raises(ValueError, match="n > 1: forking a sequence with per-request state"):
        bm.fork(seqs[0], seqs[0].fork(9, 1))
    bm.free(seqs[0])
    assert bm.can_allocate(seqs[2])
