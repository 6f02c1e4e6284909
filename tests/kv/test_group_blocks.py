"""Per-group block tables (kv/spec.py: table groups, kv/group_blocks.py): the real Scheduler and GroupedBlockManager
driven by a fake model that simulates the paged cache of each table group. Before computing, every query position
reads back what its group's layers read through that group's table: all earlier (token, position) pairs for the
full group, the window's for a sliding one; so a block released while still read, a block shared by two groups,
or a prefix hit on a block whose content is gone shows up as a wrong read. Outputs are a deterministic function
of the tokens: they must not depend on the pool size, preemption or prefix hits. Also: the groups of real
configs, the bytes of a page, and that the same bytes admit more long sequences than one table did."""

import random

import pytest

from turnout.engine.sampling_params import SamplingParams
from turnout.engine.scheduler import Preemption, Scheduler
from turnout.engine.sequence import Sequence, SequenceStatus
from turnout.kv.block_manager import BlockManager
from turnout.kv.group_blocks import GroupedBlockManager
from turnout.kv.spec import CacheLayout, FullAttentionSpec, SlidingWindowSpec


def next_token(tokens, seed=0):
    h = seed * 1_000_003 + len(tokens)
    for t in tokens[-8:]:
        h = (h * 31 + t) % 1_000_000_007
    return h % 997


def reference(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class GroupEngine:
    def __init__(self, num_blocks, windows, block_size=4, max_num_seqs=8, budget=16, prefix_caching=True,
                 swap_blocks=0, mode="recompute", offload_blocks=0):
        self.bm = GroupedBlockManager(windows, num_blocks, block_size, prefix_caching, swap_blocks=swap_blocks,
                                      offload_blocks=offload_blocks)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, 1024, preemption=Preemption(mode))
        self.windows, self.bs = windows, block_size
        self.kv, self.host, self.seqs = {}, {}, {}  # block -> [(group, token, position)] * block_size
        self.most = [0] * len(windows)  # the most live blocks a decoding sequence held, per group

    def add(self, rid, prompt, max_tokens):
        seq = Sequence(self.sched.new_seq_id(), rid, prompt, SamplingParams(max_tokens=max_tokens), 0,
                       arrival_time=len(self.seqs))
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
            for g, (w, table) in enumerate(zip(self.windows, seq.block_tables)):
                first = 0 if w is None else max(0, e.start - w + 1)
                for pos in range(first, e.start):  # what the first query of group g reads
                    block = table[pos // bs]
                    assert block != null, (seq, g, pos, "read but released")
                    assert self.kv[block][pos % bs] == (g, seq.token_ids[pos], pos), (seq, g, pos)
                for pos in range(e.start, e.start + e.num_tokens):
                    block = table[pos // bs]
                    assert block != null and bm.groups[g].blocks[block].ref_count == 1
                    assert (block, pos % bs) not in written
                    written.add((block, pos % bs))
                    self.kv.setdefault(block, [None] * bs)[pos % bs] = (g, seq.token_ids[pos], pos)
            if e.num_tokens == 1:
                self.most = [max(m, len(live)) for m, live in zip(self.most, bm.live_blocks(seq))]
        sampled = [(e.seq, next_token(e.seq.token_ids)) for e in out.scheduled if e.sample]
        self.sched.postprocess(out)
        for seq, tok in sampled:
            seq.append_token(tok)
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        per_group = [set() for _ in self.windows]  # (sequences share blocks through prefix hits)
        for s in self.sched.running:
            for g, live in enumerate(bm.live_blocks(s)):
                per_group[g].update(live)
        held = set().union(*per_group)
        assert len(held) == sum(map(len, per_group))  # no block in two groups
        assert bm.num_free_blocks == bm.capacity - len(held)  # released blocks are free again
        return out

    def run(self, max_steps=20_000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return {s.request_id: s.output_token_ids for s in self.seqs.values()}
            self.step()
        raise AssertionError("did not finish")


def test_a_long_generation_holds_every_full_block_and_the_window_s_sliding_ones():
    eng = GroupEngine(num_blocks=200, windows=[None, 8, 8], prefix_caching=False)
    eng.add("a", [3, 1, 4, 1, 5], max_tokens=300)
    assert eng.run()["a"] == reference([3, 1, 4, 1, 5], 300)
    assert eng.most[0] == -(-304 // 4) and eng.most[1] == eng.most[2] == -(-8 // 4) + 1
    assert eng.bm.num_free_blocks == eng.bm.capacity


@pytest.mark.parametrize("prefix_caching,offload", [(True, 0), (False, 0), (True, 60)])
@pytest.mark.parametrize("mode,swap_blocks", [("recompute", 0), ("swap", 40)])
def test_stress_with_shared_prefixes_and_preemption_matches_the_reference(prefix_caching, offload, mode,
                                                                           swap_blocks):
    rng = random.Random(5)
    prefix = [rng.randrange(1000) for _ in range(30)]
    reqs = [(f"r{i}", (prefix if i % 2 else prefix[:9]) + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))],
             rng.randrange(20, 70)) for i in range(10)]
    eng = GroupEngine(num_blocks=70, windows=[None, 6, 6, 10], budget=24, prefix_caching=prefix_caching,
                      swap_blocks=swap_blocks, mode=mode, offload_blocks=offload)
    for rid, prompt, mt in reqs:
        eng.add(rid, prompt, mt)
    out = eng.run()
    assert eng.sched.num_preemptions > 0
    if mode == "swap":
        assert eng.sched.num_swap_preemptions > 0
    if prefix_caching:
        assert eng.sched.num_prefix_cached_tokens > 0
    for rid, prompt, mt in reqs:
        assert out[rid] == reference(prompt, mt)
    assert eng.bm.num_free_blocks == eng.bm.capacity and eng.bm.swap_pool.num_free == swap_blocks
    if offload:  # the host prefix tier (kv/tiers.py) took evicted blocks of every group, and gave hits back
        assert eng.bm.host_cache.num_offloaded > 0 and eng.bm.num_host_hit_tokens > 0


def test_a_prefix_hit_needs_the_sliding_group_s_window_at_the_hit_point():
    eng = GroupEngine(num_blocks=60, windows=[None, 8], budget=64)
    a = eng.add("a", list(range(100, 110)), max_tokens=30)
    eng.run()
    b = eng.add("b", a.token_ids[:36], max_tokens=3)  # every block of both groups still cached
    eng.step()
    assert b.num_cached_tokens == 32
    skip = eng.bm.groups[1]._window_start(32)
    assert b.group_tables[0][:skip] == [0] * skip and 0 not in b.block_table  # only the window taken
    eng.run()
    assert b.output_token_ids == reference(a.token_ids[:36], 3)
    # evict the sliding group's blocks of the window before position 24 (its hash chain's blocks 4..5): a hit
    # of 24+ tokens is then impossible for it, and the hit is shortened to where its window is whole again
    m = eng.bm.groups[1]
    for block in list(m._free_cached):
        if m.blocks[block].token_ids == tuple(a.token_ids[20:24]):
            m._ref(block)
            m.blocks[block].forget()
            m._unref(block)
    c = eng.add("c", a.token_ids[:36], max_tokens=3)
    eng.step()
    assert 0 < c.num_cached_tokens <= 20
    eng.run()
    assert c.output_token_ids == reference(a.token_ids[:36], 3)


def _gemma3_specs(layers, every=6):
    full, slide = FullAttentionSpec(8, 256, "bfloat16"), SlidingWindowSpec(8, 256, "bfloat16", window=1024)
    return tuple(full if (i + 1) % every == 0 else slide for i in range(layers))


def test_the_groups_of_real_configs():
    gemma12b = CacheLayout(_gemma3_specs(48))
    groups = gemma12b.table_groups
    assert [g.window for g in groups] == [None] + [1024] * 5 and all(len(g.layers) == 8 for g in groups)
    assert groups[0].layers == tuple(range(5, 48, 6))
    assert len(set(gemma12b.cache_owner)) == 8  # eight tensor sets shared by the six groups
    assert gemma12b.block_bytes(16) == 16 * 8 * 2 * 8 * 256 * 2
    gemma1b = CacheLayout(_gemma3_specs(26))  # 4 full, 22 sliding: groups of 4, the last sliding one short
    assert [len(g.layers) for g in gemma1b.table_groups] == [4, 4, 4, 4, 4, 4, 2]
    gpt_oss = CacheLayout(tuple(SlidingWindowSpec(8, 64, "bfloat16", window=128) if i % 2 == 0 else
                                FullAttentionSpec(8, 64, "bfloat16") for i in range(24)))
    assert [g.window for g in gpt_oss.table_groups] == [None, 128]
    mistral = CacheLayout((SlidingWindowSpec(8, 128, "bfloat16", window=4096),) * 4)  # one spec: one table
    assert len(mistral.table_groups) == 1 and mistral.cache_owner == (0, 1, 2, 3) and mistral.window == 4096
    odd = CacheLayout((FullAttentionSpec(8, 128, "bfloat16"), SlidingWindowSpec(8, 64, "bfloat16", window=8)))
    assert len(odd.table_groups) == 1  # shapes differ: no shared pages, one table as before


def test_the_same_bytes_admit_more_long_sequences_than_one_table():
    """Gemma-3-like 5:1 (6 layers, window 8), sequences prefilled to 200 tokens in chunks of 16 and held: the
    bytes of 61 six-layer blocks hold one (50 blocks) as one table; as 366 one-layer pages, per-group tables hold
    four (50 full-group pages + at most 7 per sliding group each)."""
    layers, bs, total_layer_blocks = 6, 4, 6 * 60 + 6  # 61 blocks of 6 layers: 366 pages of one layer (+ null)

    def admitted(bm, steps=200 // 16 + 1):
        n = 0
        while True:
            seq = Sequence(n, str(n), list(range(1000 + n, 1000 + n + 200)), None, 0)
            if not bm.can_allocate(seq, 16, []):
                return n
            bm.allocate(seq, 16, [])
            for _ in range(steps):
                seq.num_computed_tokens = min(seq.num_computed_tokens + 16, 200)
                if seq.num_computed_tokens == 200:
                    break
                if not bm.can_append(seq, 16):
                    return n
                bm.append_slots(seq, 16)
            n += 1

    one = BlockManager(total_layer_blocks // layers, bs, False)
    groups = GroupedBlockManager([None] + [8] * 5, total_layer_blocks, bs, False)
    assert (admitted(one), admitted(groups)) == (1, 4)


def test_sliding_groups_of_two_widths_and_forks():
    """No full group (two windows): hits are found from the sliding groups alone; n > 1 forks share every group's
    blocks and copy the shared partial block on write in each group."""
    eng = GroupEngine(num_blocks=80, windows=[5, 9], budget=16)
    a = eng.add("a", list(range(200, 223)), max_tokens=12)
    eng.run()
    b = eng.add("b", a.token_ids[:30], max_tokens=6)
    eng.run()
    assert b.num_cached_tokens > 0 and b.output_token_ids == reference(a.token_ids[:30], 6)
    bm = GroupedBlockManager([None, 4], 40, 4, False)
    p = Sequence(0, "p", list(range(10)), None, 0)
    bm.allocate(p)
    p.num_computed_tokens = 10
    c = p.fork(1, 1)
    bm.fork(p, c)
    assert [len(x) for x in bm.live_blocks(c)] == [3, 3] and c.block_tables == p.block_tables
    p.append_token(1)
    c.append_token(2)
    copies = bm.append_slots(p, 1) + bm.append_slots(c, 1)
    assert len(copies) == 2  # the shared block holding token 10 of each group, copied once (by the first writer)
    bm.free(p)
    bm.free(c)
    assert bm.num_free_blocks == bm.capacity


def test_cache_tensors_are_shared_by_group_position_only_when_asked():
    from turnout.worker.kv_sizing import allocate_caches, block_caches, cache_bytes

    slide, full = SlidingWindowSpec(1, 4, "float32", window=4), FullAttentionSpec(1, 4, "float32")
    layout = CacheLayout((slide, slide, full, slide, slide, full))  # groups of 2: full (2, 5), sliding (0, 1), (3, 4)
    assert layout.cache_owner == (0, 1, 0, 0, 1, 1)
    shared = allocate_caches(layout, 3, 4, 1, "cpu", shared=True)  # the runner's: a block id is a 2-layer page
    assert all(shared[i][0] is shared[layout.cache_owner[i]][0] for i in range(6))
    assert [len(c) for c in block_caches(shared, layout)] == [2, 2, 0, 0, 0, 0]  # the owners move the pages
    assert cache_bytes(shared) == 3 * layout.block_bytes(4)  # the pool is num_blocks pages, no more
    own = allocate_caches(layout, 3, 4, 1, "cpu")  # a standalone forward with one table: every layer its own
    assert len({id(c[0]) for c in own}) == 6
