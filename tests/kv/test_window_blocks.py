"""Sliding-window blocks (kv/block_manager.py ``window``): the real Scheduler and BlockManager driven by a fake
model that simulates the paged cache. Before computing, every query position reads back its window's
(token, position) pairs through the block table, so a released block still in use, a null entry inside the
window, or a prefix hit on a block whose content is gone shows up as a wrong read; outputs are a
deterministic function of the tokens, so they must not depend on the cache size, preemption or prefix hits.
"""

import random

import pytest

from turnout.engine.sampling_params import SamplingParams
from turnout.engine.scheduler import Preemption, Scheduler
from turnout.engine.sequence import Sequence, SequenceStatus
from turnout.kv.block_manager import BlockManager
from turnout.kv.spec import blocks_spanned


def next_token(tokens, seed):
    h = seed * 1_000_003 + len(tokens)
    for t in tokens[-8:]:
        h = (h * 31 + t) % 1_000_000_007
    return h % 997


def reference(prompt, max_tokens, seed=0):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, seed))
    return tokens[len(prompt):]


class WindowEngine:
    def __init__(self, num_blocks, window, block_size=4, max_num_seqs=8, budget=16, max_model_len=1024,
                 prefix_caching=True, swap_blocks=0, mode="recompute"):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, swap_blocks=swap_blocks, window=window)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, max_model_len, preemption=Preemption(mode))
        self.window, self.bs = window, block_size
        self.kv = {}  # device block -> [(token, position)] * block_size
        self.host = {}
        self.seqs = {}
        self.max_live_decode = 0  # the most blocks a decoding sequence held
        self.max_live_chunk = {}  # chunk size -> the most blocks a sequence computing such a chunk held

    def add(self, rid, prompt, max_tokens, arrival=None):
        seq = Sequence(self.sched.new_seq_id(), rid, prompt, SamplingParams(max_tokens=max_tokens), 0,
                       arrival_time=len(self.seqs) if arrival is None else arrival)
        self.sched.add(seq)
        self.seqs[seq.seq_id] = seq
        return seq

    def step(self):
        out = self.sched.schedule()
        bm, bs, null = self.bm, self.bs, self.bm.null_block
        for d, h in out.swap_out:
            self.host[h] = list(self.kv[d])
        for s, d in out.copy_on_write:
            self.kv[d] = list(self.kv[s])
        for h, d in out.swap_in:
            self.kv[d] = list(self.host[h])
        written = set()
        for e in out.scheduled:
            seq = e.seq
            for pos in range(max(0, e.start - self.window + 1), e.start):  # what the first query reads
                block = seq.block_table[pos // bs]
                assert block != null, (seq, pos, "inside the window but released")
                assert self.kv[block][pos % bs] == (seq.token_ids[pos], pos), (seq, pos)
            for pos in range(e.start, e.start + e.num_tokens):
                block = seq.block_table[pos // bs]
                assert block != null and bm.blocks[block].ref_count == 1 and (block, pos % bs) not in written
                written.add((block, pos % bs))
                self.kv.setdefault(block, [None] * bs)[pos % bs] = (seq.token_ids[pos], pos)
            live = len(bm.live_blocks(seq))
            if e.num_tokens == 1:
                self.max_live_decode = max(self.max_live_decode, live)
            self.max_live_chunk[e.num_tokens] = max(self.max_live_chunk.get(e.num_tokens, 0), live)
        sampled = [(e.seq, next_token(e.seq.token_ids, 0)) for e in out.scheduled if e.sample]
        self.sched.postprocess(out)
        for seq, tok in sampled:
            seq.append_token(tok)
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        held = {b for s in self.sched.running for b in bm.live_blocks(s)}
        assert bm.num_free_blocks == bm.capacity - len(held)  # released blocks are free again
        assert bm.blocks[null].ref_count == 0 and null not in bm._free_plain and null not in bm._free_cached
        return out

    def run(self, max_steps=20_000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return {s.request_id: s.output_token_ids for s in self.seqs.values()}
            self.step()
        raise AssertionError("did not finish")


@pytest.mark.parametrize("block_size", [4, 8])
def test_a_long_generation_holds_at_most_the_window_s_blocks(block_size):
    eng = WindowEngine(num_blocks=64, window=16, block_size=block_size, prefix_caching=False)
    eng.add("a", [3, 1, 4, 1, 5], max_tokens=300)
    out = eng.run()
    assert out["a"] == reference([3, 1, 4, 1, 5], 300)
    assert eng.max_live_decode <= -(-16 // block_size) + 1  # ceil(W / block_size) + 1
    assert eng.bm.num_window_released >= 300 // block_size - 6
    for n, live in eng.max_live_chunk.items():
        assert live <= blocks_spanned(16 + n, block_size)


def test_a_sequence_longer_than_the_cache_is_admitted_when_the_window_bounds_it():
    # 10 usable blocks of 4 tokens = 40 tokens; the sequence grows to 205: fine with a window of 16
    eng = WindowEngine(num_blocks=11, window=16, budget=8)
    eng.add("a", list(range(5)), max_tokens=200)
    assert eng.run()["a"] == reference(list(range(5)), 200)
    full = BlockManager(11, 4)
    sched = Scheduler(full, 8, 8, 1024)
    with pytest.raises(ValueError, match="need 52 KV blocks"):
        sched.add(Sequence(0, "a", list(range(5)), SamplingParams(max_tokens=200), 0))


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("mode,swap_blocks", [("recompute", 0), ("swap", 12)])
def test_stress_with_shared_prefixes_and_preemption_matches_the_reference(prefix_caching, mode, swap_blocks):
    rng = random.Random(5)
    prefix = [rng.randrange(1000) for _ in range(30)]
    reqs = [(f"r{i}", (prefix if i % 2 else prefix[:9]) + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))],
             rng.randrange(20, 90)) for i in range(10)]
    tiny = WindowEngine(num_blocks=20, window=12, budget=24, prefix_caching=prefix_caching, swap_blocks=swap_blocks,
                        mode=mode)
    for rid, prompt, mt in reqs:
        tiny.add(rid, prompt, mt)
    out = tiny.run()
    assert tiny.sched.num_preemptions > 0
    if mode == "swap":
        assert tiny.sched.num_swap_preemptions > 0
    for rid, prompt, mt in reqs:
        assert out[rid] == reference(prompt, mt)
    assert tiny.bm.num_free_blocks == tiny.bm.capacity


def test_a_prefix_hit_takes_only_the_window_and_never_an_evicted_block():
    eng = WindowEngine(num_blocks=40, window=8, budget=64)
    a = eng.add("a", list(range(100, 110)), max_tokens=40)
    eng.run()
    # b asks for a's whole text: its leading blocks were released by a but kept their content (cached, free)
    b = eng.add("b", a.token_ids[:48], max_tokens=5)
    eng.step()
    assert b.num_cached_tokens == 44  # 11 full blocks hit (the block of the last token is computed)
    assert b.block_table[:eng.bm._window_start(44)] == [eng.bm.null_block] * eng.bm._window_start(44)
    eng.run()
    assert b.output_token_ids == reference(a.token_ids[:48], 5)
    # c shares a's prompt, but other requests evicted a's early blocks first: its chain breaks where a block
    # was given away, and it recomputes from there (the reads above check every block it is given)
    for i in range(6):
        eng.add(f"x{i}", [900 + i] * 20, max_tokens=20)
    eng.run()
    c = eng.add("c", a.token_ids[:48], max_tokens=5)
    eng.run()
    assert c.num_cached_tokens < 44 and c.output_token_ids == reference(a.token_ids[:48], 5)


def test_swap_out_copies_only_the_live_blocks():
    bm = BlockManager(32, 4, swap_blocks=16, window=8)
    s = Sequence(0, "a", list(range(30)), None, 0)
    bm.allocate(s)
    s.num_computed_tokens = 30
    bm.register_computed_blocks(s)
    s.append_token(7)
    bm.append_slots(s, 1)  # computing from 30: entries before (30 - 8) // 4 = 5 are released
    assert s.block_table[:5] == [0] * 5 and len(bm.live_blocks(s)) == 3
    assert bm.swap_out(s)
    out, _ = bm.take_transfers()
    assert len(out) == 3 and bm.swap_pool.num_free == 13
    assert bm.can_swap_in(s, 1)
    bm.swap_in(s)
    _, into = bm.take_transfers()
    assert s.block_table[:5] == [0] * 5 and len(into) == 3 and 0 not in [d for _, d in into]
    assert bm.swap_pool.num_free == 16
    bm.free(s)
    assert bm.num_free_blocks == bm.capacity == 31
