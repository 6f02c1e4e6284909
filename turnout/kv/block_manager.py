"""Paged KV blocks: reference counts, copy-on-write, and the prefix cache. Plain Python, no torch.

A sequence's KV lives in ``seq.block_table`` (block ids; token ``i`` sits in block ``i // block_size`` at
offset ``i % block_size``). Blocks are shared by reference count: between the samples of one request
after a fork, and between requests through the prefix cache.

Prefix cache. A FULL block whose tokens are all computed is registered under a hash chain: ``hash((hash
of the previous block or None, tuple of the block's token ids))``, so one hash names the whole prefix up
to the block's end. A hit is checked against the stored parent hash and token ids too, so a hash
collision cannot give a wrong hit. When its last reference goes, a registered block keeps its content
and stays findable; it is only given away (evicted) when no plain free block is left, least recently
freed first. A sequence's blocks are freed tail first, so that the tail of a chain is evicted before its
head, which more requests share.

Host tier (kv/tiers.py). With a prefix tier, an evicted registered block is copied to host memory first
(the same hash names it there), and ``match_prefix`` continues a chain in the host tier where the device
has no block: such a hit (``HostHit``) takes a fresh device block and is copied back before the step's
forward. With a swap pool, ``swap_out`` copies a preempted sequence's computed blocks to host blocks it owns
and ``swap_in`` brings them back. The copies are queued here (``take_transfers``) and run by the runner in
the order kv/tiers.py gives.

Sliding window (``window``: every token layer reads only the last ``window`` tokens, kv/spec.py). Before a
sequence computes from position ``s``, the blocks wholly before ``s - window`` are released and their
entries in its table become the null block (block 0, reserved: never handed out, never written), so the
table keeps its positions (token ``i`` is still in entry ``i // block_size``) while the sequence holds at most
``CacheLayout.max_blocks`` live blocks. A released block goes back like any freed one: registered, it stays
findable with its content intact until evicted, which removes its hash, so a prefix hit never points at a
block whose content is gone; a later request sharing a prefix whose early blocks were evicted recomputes
from where the chain breaks. Attention reads nothing before the window, so the null entries are never read
for their content (a kernel that loads a whole table row loads block 0: valid memory).

Per-request state (kv/state_slots.py): with ``state_slots``, each sequence also holds one state slot from
its first schedule to its end, swapped with its blocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol

from turnout.kv.spec import blocks_spanned
from turnout.kv.state_slots import StateSlots
from turnout.kv.tiers import HostBlockPool, HostHit, HostPrefixCache


class KVSequence(Protocol):
    """What the block manager needs of a sequence (engine/sequence.py's Sequence is one); kv/ imports
    nothing from engine/. It reads the tokens and how many are computed, and owns ``block_table``."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]

    @property
    def num_tokens(self) -> int: ...


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set once the block is full and computed (prefix caching only)
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()

    def forget(self) -> None:
        self.hash = None
        self.parent_hash = None
        self.token_ids = ()


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 swap_blocks: int = 0, offload_blocks: int = 0, window: int | None = None, state_slots: int = 0,
                 state_swap_slots: int = 0):
        if num_blocks < 1 + (window is not None) or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= {1 + (window is not None)} and block_size >= 1, got "
                             f"{num_blocks}, {block_size}")
        if window is not None and window < 1:
            raise ValueError(f"BlockManager: window must be >= 1 or None, got {window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        # the null block stands in the tables for blocks released out of the window (module docstring)
        self.null_block = 0 if window is not None else None
        self.capacity = num_blocks - (window is not None)  # blocks a sequence can be given
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free, no cached content: used first
        self._free_plain: deque[int] = deque(range(num_blocks - self.capacity, num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free, registered: oldest freed first
        self._hash_to_block: dict[int, int] = {}
        # stats
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache (at first schedules)
        self.num_hit_tokens = 0  # of those, found
        self.num_evictions = 0  # cached blocks given away for new content
        self.num_copy_on_write = 0
        self.num_prefix_forgets = 0  # forget_prefix_cache calls (weight updates, clear_kv_cache)
        # host tier: host ids [0, swap_blocks) swap pool, [swap_blocks, +offload_blocks) prefix tier
        self.swap_pool = HostBlockPool(swap_blocks)
        self.host_cache = (HostPrefixCache(offload_blocks, base=swap_blocks)
                           if offload_blocks > 0 and enable_prefix_caching else None)
        self.swapped: dict[int, list[int]] = {}  # seq_id -> its host blocks (swapped out)
        self._to_host: list[tuple[int, int]] = []  # (device, host) copies queued for this step
        self._to_device: list[tuple[int, int]] = []  # (host, device)
        self._host_to_free: list[int] = []  # swap blocks read back this step: free once the step's copies are queued
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_host_hit_tokens = 0  # prefix hits found in the host tier (part of num_hit_tokens)
        self.num_window_released = 0  # blocks released as they fell out of the window
        self.states = StateSlots(state_slots, state_swap_slots) if state_slots else None

    # ---- state ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (including cached ones that may still be hit)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence."""
        return 1.0 - self.num_free_blocks / self.capacity

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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

    # ---- raw block moves ------------------------------------------------------------------------
    def _take_free(self) -> int:
        if self._free_plain:
            block_id = self._free_plain.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
            if self.host_cache is not None:  # keep it in host memory, under the same hash
                host_id = self.host_cache.offload(block.hash, block.parent_hash, block.token_ids)
                if host_id is not None:
                    self._to_host.append((block_id, host_id))
            block.forget()
            self.num_evictions += 1
        self.blocks[block_id].ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:  # a cached free block comes back to life
            del self._free_cached[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._free_cached[block_id] = None
            else:
                self._free_plain.append(block_id)

    # ---- first schedule -------------------------------------------------------------------------
    def match_prefix(self, seq: KVSequence) -> list[int]:
        """Ids of cached blocks holding ``seq``'s leading full blocks (a ``HostHit`` where the block is in
        the host tier only). The block that holds the last token never counts, so at least one token is
        computed (its logits are needed). No state changes."""
        if not self.enable_prefix_caching or getattr(seq, "skip_prefix_cache", False):
            return []  # (a sequence whose every prompt position must be computed: prompt_logprobs)
        bs, tokens = self.block_size, seq.token_ids
        hits: list = []
        parent = None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            block_id = self._hash_to_block.get(h)
            if block_id is not None:
                block = self.blocks[block_id]
                if block.parent_hash != parent or block.token_ids != chunk:
                    break
                hits.append(block_id)
            else:
                host_id = None if self.host_cache is None else self.host_cache.lookup(h, parent, chunk)
                if host_id is None:
                    break
                hits.append(HostHit(host_id, h, parent, chunk))
            parent = h
        return hits

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

    # ---- swap (preemption to the host pool) ------------------------------------------------------
    def _computed_live(self, seq: KVSequence) -> list[int]:
        """Indices in the table of the live blocks holding computed tokens."""
        n = self.blocks_for(seq.num_computed_tokens)
        return [i for i, b in enumerate(seq.block_table[:n]) if b != self.null_block]

    def can_swap_out(self, seq: KVSequence) -> bool:
        if self.states is not None and not self.states.can_swap_out():
            return False
        return len(self._computed_live(seq)) <= self.swap_pool.num_free

    def swap_out(self, seq: KVSequence, undo_copies: list[tuple[int, int]] = ()) -> bool:
        """Copy the blocks holding ``seq``'s computed tokens to host blocks it then owns, and free its
        device blocks; ``num_computed_tokens`` stays. ``undo_copies``: copy-on-write pairs (src, dst)
        scheduled for ``seq`` in this step and dropped with it: dst holds nothing yet, so src is read
        (its sibling holds it, and nothing writes a block before this step's device -> host copies ran).
        False (nothing done) when the pool has too few free blocks."""
        live = self._computed_live(seq)
        if self.states is not None and not self.states.can_swap_out():
            return False
        host = self.swap_pool.allocate(len(live))
        if host is None:
            return False
        read = dict((dst, src) for src, dst in undo_copies)
        table = seq.block_table
        self._to_host.extend((read.get(table[i], table[i]), h) for i, h in zip(live, host))
        # host block per table entry up to the computed end; None where the window released it
        slots: list[int | None] = [None] * self.blocks_for(seq.num_computed_tokens)
        for i, h in zip(live, host):
            slots[i] = h
        self.swapped[seq.seq_id] = slots
        self.num_swapped_out_blocks += len(live)
        if self.states is not None:
            self.states.swap_out(seq.seq_id)
        self.free(seq)
        return True

    def can_swap_in(self, seq: KVSequence, num_new_tokens: int) -> bool:
        host = self.swapped[seq.seq_id]
        grow = max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(host))
        if self.states is not None and not self.states.num_free:
            return False
        return sum(h is not None for h in host) + grow <= self.num_free_blocks

    def swap_in(self, seq: KVSequence) -> None:
        """Fresh device blocks for a swapped-out sequence, its host blocks queued to be copied into them
        (before the step's forward). Check ``can_swap_in`` first; then ``append_slots`` as usual."""
        assert not seq.block_table, f"swap_in: sequence {seq.seq_id} already holds blocks"
        host = self.swapped.pop(seq.seq_id)
        seq.block_table = [self.null_block if h is None else self._take_free() for h in host]
        live = [(h, d) for h, d in zip(host, seq.block_table) if h is not None]
        self._to_device.extend(live)
        self._host_to_free.extend(h for h, _ in live)  # not reusable before this step's copies are queued
        self.num_swapped_in_blocks += len(live)
        if self.states is not None:
            self.states.swap_in(seq.seq_id)

    def drop_swapped(self, seq: KVSequence) -> None:
        """A swapped-out sequence ended (aborted, failed): its host blocks go back to the pool."""
        host = self.swapped.pop(seq.seq_id, None)
        if host:
            self.swap_pool.free([h for h in host if h is not None])
        if self.states is not None:
            self.states.drop_swapped(seq.seq_id)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies queued since the last call: ((device, host) to run first, (host, device) after
        copy-on-write), in the order kv/tiers.py describes. Ends the step's pins."""
        out, into = self._to_host, self._to_device
        self._to_host, self._to_device = [], []
        self.swap_pool.free(self._host_to_free)
        self._host_to_free = []
        if self.host_cache is not None:
            self.host_cache.unpin_all()
        return out, into

    @property
    def num_host_blocks(self) -> int:
        return self.swap_pool.num_blocks + (self.host_cache.num_blocks if self.host_cache is not None else 0)

    # ---- prefix cache ---------------------------------------------------------------------------
    def register_computed_blocks(self, seq: KVSequence) -> None:
        """Register the full blocks of ``seq`` whose tokens are all computed and that are not yet
        registered. Registered blocks form a prefix of the block table, so this walks back from the
        last full computed block to the first registered one (usually zero or one step)."""
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, seq.block_table
        num_full = min(seq.num_computed_tokens // bs, len(table))
        first = num_full
        while first > 0 and table[first - 1] != self.null_block and self.blocks[table[first - 1]].hash is None:
            first -= 1
        if first > 0 and table[first - 1] == self.null_block:
            return  # the chain's parent was released unregistered (swapped back in): these stay unregistered
        parent = self.blocks[table[first - 1]].hash if first > 0 else None
        for i in range(first, num_full):
            block = self.blocks[table[i]]
            chunk = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.parent_hash, block.token_ids = parent, chunk
            block.hash = parent = block_hash(parent, chunk)
            # an identical block computed by another sequence in the same step keeps the entry
            self._hash_to_block.setdefault(block.hash, block.block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content of free blocks. False (nothing done) while any block is in use."""
        if self.num_free_blocks != self.capacity:
            return False
        for block_id in list(self._free_cached):
            self.blocks[block_id].forget()
            self._free_plain.append(block_id)
        self._free_cached.clear()
        self._hash_to_block.clear()
        if self.host_cache is not None:
            self.host_cache.clear()
        return True

    def forget_prefix_cache(self) -> int:
        """Make every cached prefix unreachable, whatever is in use (after a weight update the cached KV
        was computed with the old weights): free cached blocks become plain, and a block held by a running
        sequence gets a hash of its own that no chain from the first block can reach, so no new request
        matches it and the sequence, which keeps it, does not register it again under a reachable hash
        (its later blocks chain from it, unreachable too). Returns the number of blocks forgotten."""
        forgotten = len(self._free_cached)
        for block_id in list(self._free_cached):
            self.blocks[block_id].forget()
            self._free_plain.append(block_id)
        self._free_cached.clear()
        for block in self.blocks:
            if block.ref_count > 0 and block.hash is not None:
                block.hash = hash(("stale", self.num_prefix_forgets, block.block_id))  # unique per block and call
                forgotten += 1
        self._hash_to_block.clear()
        if self.host_cache is not None:  # computed with the old weights too
            forgotten += self.host_cache.clear()
        self.num_prefix_forgets += 1
        return forgotten

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
