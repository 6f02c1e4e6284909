"""BlockManager.forget_prefix_cache (what a weight update calls): no cached prefix stays reachable, blocks in
use included, and a sequence still running on the old KV never registers it again under a reachable hash."""

from turnout.engine.sequence import Sequence
from turnout.kv.block_manager import BlockManager

BS = 4


def _seq(tokens, seq_id):
    return Sequence(seq_id, f"r{seq_id}", list(tokens), None, 0)


def _compute_all(bm, s):
    s.num_computed_tokens = s.num_tokens
    bm.register_computed_blocks(s)


def test_forget_makes_free_and_in_use_prefixes_unreachable():
    bm = BlockManager(16, BS)
    done, running = _seq(range(12), 0), _seq(range(100, 112), 1)
    for s in (done, running):
        bm.allocate(s)
        _compute_all(bm, s)
    bm.free(done)
    assert bm.match_prefix(_seq(range(12), 2)) and bm.match_prefix(_seq(range(100, 112), 3))  # both cached
    assert bm.forget_prefix_cache() == 6
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 16 - 3
    assert bm.match_prefix(_seq(range(12), 4)) == [] and bm.match_prefix(_seq(range(100, 112), 5)) == []
    # the running sequence computes more: its new full block chains from a stale hash, unreachable too
    running.append_token(200)
    running.append_token(201)
    bm.append_slots(running, 2)
    running.append_token(202)
    running.append_token(203)
    bm.append_slots(running, 2)
    _compute_all(bm, running)
    assert bm.blocks[running.block_table[-1]].hash is not None  # registered, but under a stale chain
    stale = {bm.blocks[b].hash for b in running.block_table[:3]}
    assert len(stale) == 3 and not stale & set(bm._hash_to_block)  # the old blocks: unique hashes, not indexed
    assert bm.match_prefix(_seq(list(range(100, 112)) + [200, 201, 202, 203, 9], 6)) == []
    bm.free(running)
    assert bm.match_prefix(_seq(list(range(100, 112)) + [200, 201, 202, 203, 9], 7)) == []
    # new content computed after the forget is cached as usual
    fresh = _seq(range(12), 8)
    bm.allocate(fresh)
    _compute_all(bm, fresh)
    bm.free(fresh)
    assert bm.match_prefix(_seq(range(12), 9))
