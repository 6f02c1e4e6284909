"""The device's KV blocks and what the prefix cache knows of them: reference counts, the free lists, the hash
chain, eviction (to the host prefix tier where there is one). Plain Python, no torch. The base of the block
manager (kv/block_manager.py), which keeps the sequences' tables.

Prefix cache. A FULL block whose tokens are all computed is registered under a hash chain: ``hash((hash
of the previous block or None, tuple of the block's token ids))``, so one hash names the whole prefix up
to the block's end. A hit is checked against the stored parent hash and token ids too, so a hash
collision cannot give a wrong hit. When its last reference goes, a registered block keeps its content
and stays findable; it is only given away (evicted) when no plain free block is left, least recently
freed first. A sequence's blocks are freed tail first, so that the tail of a chain is evicted before its
head, which more requests share.

Host prefix tier (kv/tiers.py). An evicted registered block is copied to host memory first (the same hash
names it there), and ``match_prefix`` continues a chain in the host tier where the device has no block:
such a hit (``HostHit``) takes a fresh device block and is copied back before the step's forward. The
copies are queued here and handed to the runner with the swaps' (``take_transfers``, kv/block_swap.py).

The null block (``null_block=True``, for a sliding window): block 0 stands in the sequences' tables for
blocks released out of the window; it is never handed out, never referenced and never written.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol

from turnout.kv.tiers import HostHit, HostPrefixCache


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


class BlockPool:
    """Every device block, its reference count and its prefix-cache identity; sequences hold them through the
    block manager's tables."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, offload_blocks: int = 0,
                 host_base: int = 0, null_block: bool = False, hash_root: int | None = None):
        if num_blocks < 1 + null_block or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= {1 + null_block} and block_size >= 1, got "
                             f"{num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.null_block = 0 if null_block else None
        self.capacity = num_blocks - null_block  # blocks a sequence can be given
        self.hash_root = hash_root  # the parent of a chain's first block (a table group's own, kv/group_blocks.py)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free, no cached content: used first
        self._free_plain: deque[int] = deque(range(num_blocks - self.capacity, num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free, registered: oldest freed first
        self._hash_to_block: dict[int, int] = {}
        # stats
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache (at first schedules)
        self.num_hit_tokens = 0  # of those, found
        self.num_evictions = 0  # cached blocks given away for new content
        self.num_prefix_forgets = 0  # forget_prefix_cache calls (weight updates, clear_kv_cache)
        self.num_host_hit_tokens = 0  # prefix hits found in the host tier (part of num_hit_tokens)
        # host ids [host_base, + offload_blocks): the prefix tier (below it, the block manager's swap pool)
        self.host_cache = (HostPrefixCache(offload_blocks, base=host_base)
                           if offload_blocks > 0 and enable_prefix_caching else None)
        self._to_host: list[tuple[int, int]] = []  # (device, host) copies queued for this step
        self._to_device: list[tuple[int, int]] = []  # (host, device)

    def share_pool(self, other: BlockPool) -> None:
        """Use ``other``'s blocks, free lists, hash index and host tier (its containers, mutated in place on
        both sides): a table group of kv/group_blocks.py. Counters and queued copies stay each one's own."""
        if (other.num_blocks, other.block_size, other.null_block) != (self.num_blocks, self.block_size, self.null_block):
            raise ValueError("share_pool: the pools differ in num_blocks, block_size or null block")
        self.blocks, self._free_plain, self._free_cached = other.blocks, other._free_plain, other._free_cached
        self._hash_to_block, self.host_cache = other._hash_to_block, other.host_cache

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

    # ---- prefix cache ---------------------------------------------------------------------------
    def match_prefix(self, seq: KVSequence) -> list[int]:
        """Ids of cached blocks holding ``seq``'s leading full blocks (a ``HostHit`` where the block is in
        the host tier only). The block that holds the last token never counts, so at least one token is
        computed (its logits are needed). No state changes."""
        if not self.enable_prefix_caching or getattr(seq, "skip_prefix_cache", False):
            return []  # (a sequence whose every prompt position must be computed: prompt_logprobs)
        bs, tokens = self.block_size, seq.token_ids
        hits: list = []
        parent = self.hash_root
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
        parent = self.blocks[table[first - 1]].hash if first > 0 else self.hash_root
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
