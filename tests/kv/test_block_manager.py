import pytest

from turnout.engine.sequence import Sequence
from turnout.kv.block_manager import BlockManager

BS = 4


def seq(tokens, seq_id=0):
    return Sequence(seq_id, f"r{seq_id}", list(tokens), None, 0)


def compute_all(bm, s):
    """As the scheduler's postprocess: everything in the sequence is now computed."""
    s.num_computed_tokens = s.num_tokens
    bm.register_computed_blocks(s)


def test_allocate_free_and_usage():
    bm = BlockManager(8, BS)
    s = seq(range(10))
    assert bm.can_allocate(s) and bm.num_free_blocks == 8 and bm.usage == 0.0
    assert bm.allocate(s) == 0
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    assert all(bm.blocks[b].ref_count == 1 for b in s.block_table)
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0.0


def test_allocate_a_chunk_then_append_slots():
    bm = BlockManager(8, BS)
    s = seq(range(10))
    bm.allocate(s, num_new_tokens=3)
    assert len(s.block_table) == 1
    s.num_computed_tokens = 3
    assert bm.append_slots(s, 5) == []  # tokens 3..7: one more block
    assert len(s.block_table) == 2
    s.num_computed_tokens = 8
    assert bm.can_append(s, 2)
    bm.append_slots(s, 2)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5


def test_can_allocate_and_can_append_limits():
    bm = BlockManager(3, BS)
    big = seq(range(13))  # 4 blocks
    assert not bm.can_allocate(big) and bm.can_allocate(big, num_new_tokens=12)
    with pytest.raises(RuntimeError, match="needs 4 free blocks"):
        bm.allocate(big)
    s = seq(range(12))
    bm.allocate(s)
    s.num_computed_tokens = 12
    assert bm.num_free_blocks == 0 and not bm.can_append(s, 1)
    with pytest.raises(RuntimeError):
        bm.append_slots(s, 1)


def test_prefix_hit_reuses_full_blocks_but_never_the_last_tokens_block():
    bm = BlockManager(16, BS)
    a = seq(range(12))
    bm.allocate(a)
    compute_all(bm, a)
    # same 12 tokens: blocks 0 and 1 hit; block 2 holds the last token: computed again
    b = seq(range(12), 1)
    assert bm.match_prefix(b) == a.block_table[:2]
    assert bm.allocate(b) == 8 and b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    # a longer sequence hits all three
    c = seq(list(range(12)) + [99], 2)
    assert bm.allocate(c) == 12
    # a different second block stops the chain, even with the same third block
    d = seq([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 5], 3)
    assert bm.allocate(d) == 4
    assert bm.num_hit_tokens == 8 + 12 + 4 and bm.num_queried_tokens == 12 * 2 + 13 * 2


def test_only_full_computed_blocks_are_registered():
    bm = BlockManager(16, BS)
    a = seq(range(10))
    bm.allocate(a)
    a.num_computed_tokens = 6  # one full block computed, the second only half
    bm.register_computed_blocks(a)
    assert bm.match_prefix(seq(range(10), 1)) == a.block_table[:1]
    a.num_computed_tokens = 10
    bm.register_computed_blocks(a)
    assert bm.match_prefix(seq(range(10), 1)) == a.block_table[:2]  # the partial third block: never


def test_freed_cached_blocks_stay_findable_and_evict_least_recently_freed():
    bm = BlockManager(4, BS)
    a, b = seq(range(8)), seq(range(100, 108), 1)
    for s in (a, b):
        bm.allocate(s)
        compute_all(bm, s)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 4
    # still findable after free (only the first block: the second holds the last token of the query)
    assert bm.match_prefix(seq(range(8), 2)) == a_blocks[:1]
    assert bm.match_prefix(seq(list(range(100, 108)) + [1], 3)) == b_blocks
    # a new sequence needs 2 blocks: evicts a's (freed first), tail first
    c = seq(range(200, 206), 4)
    bm.allocate(c)
    assert c.block_table == [a_blocks[1], a_blocks[0]] and bm.num_evictions == 2
    assert bm.match_prefix(seq(range(9), 5)) == []
    assert bm.match_prefix(seq(list(range(100, 108)) + [1], 3)) == b_blocks


def test_plain_free_blocks_are_used_before_cached_ones():
    bm = BlockManager(4, BS)
    a = seq(range(4))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    c = seq(range(50, 62), 1)  # three blocks: exactly the plain ones
    bm.allocate(c)
    assert bm.num_evictions == 0 and a.block_table == [] and bm.match_prefix(seq(range(5), 2)) != []


def test_reviving_a_cached_free_block_counts_against_free_blocks():
    bm = BlockManager(2, BS)
    a = seq(range(4))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    b = seq(range(8), 1)  # hits block 0 (free, cached) + needs one new block
    cached = bm.match_prefix(b)
    assert len(cached) == 1 and bm.can_allocate(b, cached=cached)
    bm.allocate(b, cached=cached)
    assert bm.num_free_blocks == 0 and bm.num_evictions == 0
    assert [bm.blocks[x].ref_count for x in b.block_table] == [1, 1]


def test_hash_collision_is_not_a_hit(monkeypatch):
    import turnout.kv.block_pool as mod  # where the chain is hashed

    monkeypatch.setattr(mod, "block_hash", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(8, BS)
    a = seq(range(8))
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.match_prefix(seq(range(100, 109), 1)) == []
    assert bm.match_prefix(seq(range(9), 1)) == a.block_table[:1]  # block 2 has a different parent


def test_fork_and_copy_on_write():
    bm = BlockManager(8, BS)
    parent = seq(range(6))
    bm.allocate(parent)
    compute_all(bm, parent)
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and child.block_table is not parent.block_table
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table)
    assert bm.num_free_blocks == 6
    parent.append_token(7)
    child.append_token(8)
    # token 6 goes into the shared block 1: the first writer copies it, the second writes in place
    assert bm.can_append(parent, 1)
    (src, dst), = bm.append_slots(parent, 1)
    assert src == child.block_table[1] and dst == parent.block_table[1] and src != dst
    assert bm.blocks[src].ref_count == 1 and bm.blocks[dst].ref_count == 1
    assert bm.append_slots(child, 1) == []
    assert bm.num_copy_on_write == 1 and bm.num_free_blocks == 5
    assert bm.blocks[parent.block_table[0]].ref_count == 2
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_copy_on_write_needs_a_free_block():
    bm = BlockManager(2, BS)
    parent = seq(range(6))
    bm.allocate(parent)
    compute_all(bm, parent)
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    parent.append_token(1)
    assert bm.num_free_blocks == 0 and not bm.can_append(parent, 1)


def test_disabled_prefix_caching():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq(range(12))
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.match_prefix(seq(range(12), 1)) == [] and bm.num_queried_tokens == 0
    bm.free(a)
    assert bm.num_cached_free_blocks == 0


def test_reset_prefix_cache():
    bm = BlockManager(4, BS)
    a = seq(range(8))
    bm.allocate(a)
    compute_all(bm, a)
    assert not bm.reset_prefix_cache()  # in use
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.match_prefix(seq(range(9), 1)) == [] and bm.num_cached_free_blocks == 0
    assert bm.num_free_blocks == 4


def test_double_free_is_caught():
    bm = BlockManager(4, BS)
    a = seq(range(4))
    bm.allocate(a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(a)


def test_sequence_fork_seed_and_state():
    s = Sequence(3, "r", [1, 2, 3], None, seed=5, n=4, arrival_time=2.5)
    s.block_table = [7, 8]
    s.num_computed_tokens = 3
    c = s.fork(9, 2)
    assert (c.seq_id, c.request_id, c.index, c.n, c.arrival_time) == (9, "r", 2, 1, 2.5)
    assert c.seed == (5 + 2 * 0x9E3779B97F4A7C15) % 2**63
    assert c.token_ids == s.token_ids and c.token_ids is not s.token_ids
    assert c.block_table == [7, 8] and c.num_computed_tokens == 3 and c.num_prompt_tokens == 3
    c.append_token(4)
    assert s.num_tokens == 3 and c.output_token_ids == [4] and c.prompt_token_ids == [1, 2, 3]
