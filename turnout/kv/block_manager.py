"""Paged KV blocks of the sequences: their block tables, copy-on-write, forks, the sliding window's released
blocks and per-request state slots. Plain Python, no torch.

A sequence's KV lives in ``seq.block_table`` (block ids; token ``i`` sits in block ``i // block_size`` at
offset ``i % block_size``). Blocks are shared by reference count: between the samples of one request
after a fork, and between requests through the prefix cache. The blocks themselves, the prefix cache and
the host prefix tier are the pool's (kv/block_pool.py); swapping to the host pool is kv/block_swap.py.

Sliding window (``window``: every token layer reads only the last ``window`` tokens, kv/spec.py). Before a
sequence computes from position ``s``, the blocks wholly before ``s - window`` are released and their
entries in its table become the null block (block 0, reserved: never handed out, never written), so the
table keeps its positions (token ``i`` is still in entry ``i // block_size``) while the sequence holds at most
``CacheLayout.max_blocks`` live blocks. A released block goes back like any freed one: registered, it stays
findable with its content intact until evicted, which removes its hash, so a prefix hit never points at a
block whose content is gone; a later request sharing a prefix whose early blocks were evicted recomputes
from where the chain breaks. Attention reads nothing before the window, so the null entries are never read
for their content (a kernel that loads a whole table row loads block 0: valid memory).

Several table groups (a model mixing full and sliding layers): kv/group_blocks.py runs one BlockManager per
group on one shared pool (``null_block``, ``hash_root``: each group's own chains).

Per-request state (kv/state_slots.py): with ``state_slots``, each sequence also holds one state slot from
its first schedule to its end, swapped with its blocks.
"""

from __future__ import annotations

from turnout.kv.block_pool import Block, BlockPool, KVSequence, block_hash
from turnout.kv.block_swap import HostSwap
from turnout.kv.spec import blocks_spanned
from turnout.kv.state_slots import StateSlots
from turnout.kv.tiers import HostBlockPool, HostHit

__all__ = ["Block", "BlockManager", "KVSequence", "block_hash"]


class BlockManager(BlockPool, HostSwap):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 swap_blocks: int = 0, offload_blocks: int = 0, window: int | None = None, state_slots: int = 0,
                 state_swap_slots: int = 0, null_block: bool | None = None, hash_root: int | None = None):
        if window is not None and window < 1:
            raise ValueError(f"BlockManager: window must be >= 1 or None, got {window}")
        # host ids: [0, swap_blocks) the swap pool, then the prefix tier; with a window, block 0 is the null block
        # (``null_block``: also without one, for a table group sharing its pool with sliding groups)
        super().__init__(num_blocks, block_size, enable_prefix_caching, offload_blocks, host_base=swap_blocks,
                         null_block=window is not None if null_block is None else null_block, hash_root=hash_root)
        self.window = window
        self.num_copy_on_write = 0
        self.swap_pool = HostBlockPool(swap_blocks)
        self.swapped: dict[int, list[int | None]] = {}  # seq_id -> its host blocks per table entry (swapped out)
        self._host_to_free: list[int] = []  # swap blocks read back this step: free once the step's copies are queued
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_window_released = 0  # blocks released as they fell out of the window
        self.states = StateSlots(state_slots, state_swap_slots) if state_slots else None

    def max_blocks_per_seq(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of up to ``num_tokens`` tokens, computed at most ``chunk`` tokens a
        step, holds at once: all of them, or with a window what the window and one chunk span."""
        n = self.blocks_for(num_tokens)
        return n if self.window is None else min(n, blocks_spanned(self.window + max(chunk, 1), self.block_size))

    def live_blocks(self, seq: KVSequence) -> list[int]:
        """The blocks ``seq`` holds (its table without the null entries)."""
        return [b for b in seq.block_table if b != self.null_block]

    def _window_start(self, num_computed: int) -> int:
        """Table entries wholly before what a step computing from ``num_computed`` reads: the window, and one
        token more (the last one a query of the step before read, so a step in flight never loses a block)."""
        return max(0, (num_computed - self.window) // self.block_size) if self.window is not None else 0

    def _release_out_of_window(self, seq: KVSequence) -> None:
        table = seq.block_table
        for i in range(min(self._window_start(seq.num_computed_tokens), len(table))):
            if table[i] != self.null_block:
                self._unref(table[i])
                table[i] = self.null_block
                self.num_window_released += 1

    # ---- first schedule -------------------------------------------------------------------------
    def _blocks_to_allocate(self, seq: KVSequence, num_new_tokens: int | None, cached: list[int]) -> tuple[int, int]:
        num_cached_tokens = len(cached) * self.block_size
        if num_new_tokens is None:
            num_new_tokens = seq.num_tokens - num_cached_tokens
        new = self.blocks_for(num_cached_tokens + num_new_tokens) - len(cached)
        used = cached[self._window_start(num_cached_tokens):]  # hits before the window are not taken
        new += sum(1 for b in used if isinstance(b, HostHit))  # a host hit is loaded into a fresh block
        revived = sum(1 for b in used if not isinstance(b, HostHit) and self.blocks[b].ref_count == 0)
        return new, revived

    def can_allocate(self, seq: KVSequence, num_new_tokens: int | None = None, cached: list[int] | None = None) -> bool:
        """Whether ``allocate(seq, num_new_tokens, cached)`` would succeed."""
        if cached is None:
            cached = self.match_prefix(seq)
        if self.states is not None and self.states.needs_slot(seq.seq_id) and not self.states.num_free:
            return False
        new, revived = self._blocks_to_allocate(seq, num_new_tokens, cached)
        return new + revived <= self.num_free_blocks

    def allocate(self, seq: KVSequence, num_new_tokens: int | None = None, cached: list[int] | None = None) -> int:
        """First schedule of ``seq`` (empty block table): take references on the cached prefix blocks
        (``cached``: from ``match_prefix``; looked up when None), set ``seq.num_computed_tokens`` to
        the hit length, and allocate blocks for ``num_new_tokens`` more tokens (None: the rest of the
        sequence). Returns the hit length in tokens (the caller decides whether it is the sequence's
        ``num_cached_tokens``: not for a recompute). Check ``can_allocate`` first."""
        assert not seq.block_table, f"allocate: sequence {seq.seq_id} already holds blocks"
        if cached is None:
            cached = self.match_prefix(seq)
        new, revived = self._blocks_to_allocate(seq, num_new_tokens, cached)
        if new + revived > self.num_free_blocks:
            raise RuntimeError(f"allocate: sequence {seq.seq_id} needs {new + revived} free blocks, "
                               f"{self.num_free_blocks} are free")
        skip = self._window_start(len(cached) * self.block_size)  # hits the window no longer reads
        table = [self.null_block] * skip
        cached_all, cached = cached, cached[skip:]
        host_hits = [b for b in cached if isinstance(b, HostHit)]
        for block_id in cached:  # device hits first: taking free blocks below must not evict them
            if not isinstance(block_id, HostHit):
                self._ref(block_id)
        for hit in host_hits:  # nor may an eviction below give away a host block loaded in this step
            self.host_cache.pin(hit.hash)
        for b in cached:
            if isinstance(b, HostHit):
                block_id = self._take_free()
                block = self.blocks[block_id]
                block.parent_hash, block.token_ids, block.hash = b.parent_hash, b.token_ids, b.hash
                self._hash_to_block.setdefault(b.hash, block_id)
                self._to_device.append((b.host_id, block_id))
                b = block_id
            table.append(b)
        seq.block_table = table + [self._take_free() for _ in range(new - len(host_hits))]
        self.num_host_hit_tokens += len(host_hits) * self.block_size
        seq.num_computed_tokens = len(cached_all) * self.block_size
        if self.states is not None:
            self.states.take(seq.seq_id)
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    # ---- growth ---------------------------------------------------------------------------------
    def _shared_write_block(self, seq: KVSequence) -> int:
        """Index in the block table of the block the next token goes into, if it is shared (siblings
        after a fork) and so must be copied before writing; else -1."""
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return -1

    def blocks_to_append(self, seq: KVSequence, num_new_tokens: int = 1) -> int:
        """Free blocks ``append_slots(seq, num_new_tokens)`` takes (new blocks + a copy-on-write)."""
        grow = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        return max(0, grow) + (self._shared_write_block(seq) >= 0)

    def can_append(self, seq: KVSequence, num_new_tokens: int = 1) -> bool:
        return self.blocks_to_append(seq, num_new_tokens) <= len(self._free_plain) + len(self._free_cached)

    def append_slots(self, seq: KVSequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Make room for tokens ``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` of a
        sequence that already holds blocks. Returns the copy-on-write block copies ``(src, dst)`` to run
        before the forward (at most one: the shared, partly filled block the first new token goes into;
        the last sibling to write keeps the original). Check ``can_append`` first."""
        if not self.can_append(seq, num_new_tokens):
            raise RuntimeError(f"append_slots: sequence {seq.seq_id} needs "
                               f"{self.blocks_to_append(seq, num_new_tokens)} free blocks, "
                               f"{self.num_free_blocks} are free")
        self._release_out_of_window(seq)
        copies = []
        i = self._shared_write_block(seq)
        if i >= 0:
            src = seq.block_table[i]
            dst = self._take_free()
            self._unref(src)  # still referenced by a sibling: never freed here
            seq.block_table[i] = dst
            copies.append((src, dst))
            self.num_copy_on_write += 1
        table = seq.block_table
        for _ in range(-(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)):
            table.append(self._take_free())
        return copies

    def trim(self, seq: KVSequence, num_tokens: int) -> int:
        """Give back the tail blocks beyond the first ``num_tokens`` tokens (slots reserved for draft tokens
        a multi-token step rejected). Returns how many."""
        keep = self.blocks_for(num_tokens)
        tail = seq.block_table[keep:]
        for block_id in reversed(tail):
            if block_id != self.null_block:
                self._unref(block_id)
        del seq.block_table[keep:]
        return len(tail)

    def fork(self, parent: KVSequence, child: KVSequence) -> None:
        """``child`` shares every block of ``parent`` (its block table is already a copy)."""
        assert child.block_table == parent.block_table
        if self.states is not None:
            raise ValueError("n > 1: forking a sequence with per-request state (a recurrent layer) is not "
                             "supported")
        for block_id in self.live_blocks(child):
            self._ref(block_id)

    def free(self, seq: KVSequence) -> None:
        for block_id in reversed(self.live_blocks(seq)):  # tail first: evicted before the shared head
            self._unref(block_id)
        seq.block_table = []
        if self.states is not None:
            self.states.release(seq.seq_id)

    def stats(self) -> dict[str, float]:
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_cached_free_blocks": self.num_cached_free_blocks,
            "usage": self.usage,
            "prefix_queried_tokens": self.num_queried_tokens,
            "prefix_hit_tokens": self.num_hit_tokens,
            "prefix_hit_rate": self.hit_rate,
            "evictions": self.num_evictions,
            "copy_on_write": self.num_copy_on_write,
            "swapped_out_blocks": self.num_swapped_out_blocks,
            "swapped_in_blocks": self.num_swapped_in_blocks,
            "swap_pool_blocks": self.swap_pool.num_blocks,
            "swap_pool_free_blocks": self.swap_pool.num_free,
            "host_tier_blocks": 0 if self.host_cache is None else self.host_cache.num_blocks,
            "host_tier_used_blocks": 0 if self.host_cache is None else self.host_cache.num_used,
            "host_tier_offloaded_blocks": 0 if self.host_cache is None else self.host_cache.num_offloaded,
            "host_tier_hit_tokens": self.num_host_hit_tokens,
            "window_released_blocks": self.num_window_released,
        }
