"""Per-group block tables (kv/spec.py: table groups): one ``BlockManager`` per table group, all on one pool of pages.
Plain Python, no torch.

Each group's manager keeps its own table of every sequence (group 0's is ``seq.block_table``, group g's
``seq.group_tables[g - 1]``, reached through a ``_GroupView``) and runs the one-table logic on it: a sliding
group releases the blocks wholly before its window (kv/block_manager.py), a full group keeps them. The
managers share the blocks, free lists, hash index and host tier (``BlockPool.share_pool``), so a block one
group frees serves any group; each group hashes its chains from a root of its own, so a cached block is only
ever found by the group whose layers hold it. Every decision is all groups' or none: the free blocks are
checked against the sum of the groups' needs before any group takes one, and device hits of every group are
referenced (host hits pinned) before any group takes a free block that could evict them.

Prefix caching. The full group needs every block up to the hit (``match_prefix``); a sliding group needs only
those its window still reads at the hit point (``_window_match``: the chain's hashes are computed from the
tokens, and entries before the window may be missing). The hit is the longest length every group can serve;
a shorter one is taken where a sliding group lacks a block of its window.
"""

from __future__ import annotations

from turnout.kv.block_manager import BlockManager
from turnout.kv.block_pool import KVSequence, block_hash
from turnout.kv.tiers import HostBlockPool, HostHit


class _GroupView:
    """A sequence as table group ``g``'s manager sees it: its own block table, the rest the sequence's."""

    __slots__ = ("seq", "g")

    def __init__(self, seq: KVSequence, g: int):
        self.seq, self.g = seq, g

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    @property
    def skip_prefix_cache(self) -> bool:
        return getattr(self.seq, "skip_prefix_cache", False)

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:
        self.seq.num_computed_tokens = n

    @property
    def block_table(self) -> list[int]:
        return self.seq.group_tables[self.g - 1]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.seq.group_tables[self.g - 1] = table


class GroupedBlockManager:
    """The block manager of a model with several table groups: ``windows[g]`` is group g's window (None: a
    full group). Same interface as ``BlockManager`` (the scheduler cannot tell them apart)."""

    def __init__(self, windows: list[int | None], num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, swap_blocks: int = 0, offload_blocks: int = 0):
        if len(windows) < 2:
            raise ValueError(f"GroupedBlockManager: windows must name at least 2 table groups, got {windows}")
        self.groups = [BlockManager(num_blocks, block_size, enable_prefix_caching, swap_blocks=swap_blocks,
                                    offload_blocks=offload_blocks, window=w, null_block=True,
                                    hash_root=None if g == 0 else hash(("table group", g)))
                       for g, w in enumerate(windows)]
        first = self.groups[0]
        for m in self.groups[1:]:
            m.share_pool(first)
            m.swap_pool = first.swap_pool
        self.windows = list(windows)
        self.block_size, self.num_blocks, self.capacity = block_size, num_blocks, first.capacity
        self.enable_prefix_caching = enable_prefix_caching
        self.window = None  # no single window: each group has its own
        self.null_block = first.null_block

    # ---- the groups' views of a sequence ------------------------------------------------------
    def _views(self, seq: KVSequence) -> list:
        n = len(self.groups) - 1
        if len(seq.group_tables) != n:
            seq.group_tables = [[] for _ in range(n)]
        return [seq] + [_GroupView(seq, g) for g in range(1, n + 1)]

    # ---- pool state -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.groups[0].num_free_blocks

    @property
    def usage(self) -> float:
        return self.groups[0].usage

    @property
    def host_cache(self):
        return self.groups[0].host_cache

    @property
    def swap_pool(self) -> HostBlockPool:
        return self.groups[0].swap_pool

    @property
    def num_host_blocks(self) -> int:
        return self.groups[0].num_host_blocks

    def _sum(self, name: str) -> int:
        return sum(getattr(m, name) for m in self.groups)

    num_swapped_out_blocks = property(lambda self: self._sum("num_swapped_out_blocks"))
    num_swapped_in_blocks = property(lambda self: self._sum("num_swapped_in_blocks"))
    num_window_released = property(lambda self: self._sum("num_window_released"))
    num_host_hit_tokens = property(lambda self: self.groups[0].num_host_hit_tokens)

    def blocks_for(self, num_tokens: int) -> int:
        return self.groups[0].blocks_for(num_tokens)

    def max_blocks_per_seq(self, num_tokens: int, chunk: int) -> int:
        return sum(m.max_blocks_per_seq(num_tokens, chunk) for m in self.groups)

    def live_blocks(self, seq: KVSequence) -> list[list[int]]:
        """Per group, the blocks ``seq`` holds."""
        return [m.live_blocks(v) for m, v in zip(self.groups, self._views(seq))]

    # ---- prefix cache ---------------------------------------------------------------------------
    def _window_match(self, m: BlockManager, seq: KVSequence, limit: int) -> list:
        """Per leading full block (up to ``limit``), what sliding group ``m`` has of it: a device block id,
        a ``HostHit``, or None (not cached)."""
        bs, tokens, out, parent = self.block_size, seq.token_ids, [], m.hash_root
        for i in range(limit):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            b = m._hash_to_block.get(h)
            if b is not None and (m.blocks[b].parent_hash != parent or m.blocks[b].token_ids != chunk):
                b = None
            if b is None and m.host_cache is not None:
                host_id = m.host_cache.lookup(h, parent, chunk)
                b = None if host_id is None else HostHit(host_id, h, parent, chunk)
            out.append(b)
            parent = h
        return out

    def match_prefix(self, seq: KVSequence) -> list:
        """The hit every group can serve: a list of the first group's hits (its length is the hit in blocks),
        its ``per_group`` the hits of each group for ``allocate`` (None where a sliding group's window no
        longer reads the block at the hit point)."""
        per: list = [None] * len(self.groups)
        for g, m in enumerate(self.groups):  # full groups: every block up to the hit
            if m.window is None:
                per[g] = m.match_prefix(seq if g == 0 else _GroupView(seq, g))
        if any(p is not None for p in per):
            n = min(len(p) for p in per if p is not None)
        else:  # sliding groups only (windows of different widths)
            off = not self.enable_prefix_caching or getattr(seq, "skip_prefix_cache", False)
            n = 0 if off else (len(seq.token_ids) - 1) // self.block_size
        sliding = [(g, m) for g, m in enumerate(self.groups) if m.window is not None]
        for g, m in sliding:
            per[g] = self._window_match(m, seq, n) if n else []
        while n > 0 and any(b is None for g, m in sliding
                            for b in per[g][m._window_start(n * self.block_size):n]):
            n -= 1  # a sliding group lacks a block its window reads at this hit point: a shorter hit
        hits = _Hits(per[0][:n])
        hits.per_group = [p[:n] for p in per]
        return hits

    def _per_group(self, seq: KVSequence, cached) -> list[list]:
        if cached is None:
            cached = self.match_prefix(seq)
        per = getattr(cached, "per_group", None)
        if per is None:
            if cached:
                raise ValueError("cached: pass the hits GroupedBlockManager.match_prefix returned")
            per = [[] for _ in self.groups]
        return per

    # ---- first schedule -------------------------------------------------------------------------
    def _need(self, views, num_new_tokens, per) -> int:
        return sum(sum(m._blocks_to_allocate(v, num_new_tokens, c)) for m, v, c in zip(self.groups, views, per))

    def can_allocate(self, seq: KVSequence, num_new_tokens: int | None = None, cached=None) -> bool:
        views, per = self._views(seq), self._per_group(seq, cached)
        return self._need(views, num_new_tokens, per) <= self.num_free_blocks

    def allocate(self, seq: KVSequence, num_new_tokens: int | None = None, cached=None) -> int:
        views, per = self._views(seq), self._per_group(seq, cached)
        need = self._need(views, num_new_tokens, per)
        if need > self.num_free_blocks:
            raise RuntimeError(f"allocate: sequence {seq.seq_id} needs {need} free blocks, "
                               f"{self.num_free_blocks} are free")
        # every group's hits held before any group takes a free block (which could evict or overwrite them)
        held = []
        for m, c in zip(self.groups, per):
            for b in c[m._window_start(len(c) * self.block_size):]:
                if isinstance(b, HostHit):
                    m.host_cache.pin(b.hash)
                else:
                    m._ref(b)
                    held.append(b)
        n = 0
        for m, v, c in zip(self.groups, views, per):
            n = m.allocate(v, num_new_tokens, c)
        pool = self.groups[0]
        for b in held:
            pool._unref(b)
        return n

    # ---- growth ---------------------------------------------------------------------------------
    def blocks_to_append(self, seq: KVSequence, num_new_tokens: int = 1) -> int:
        return sum(m.blocks_to_append(v, num_new_tokens) for m, v in zip(self.groups, self._views(seq)))

    def can_append(self, seq: KVSequence, num_new_tokens: int = 1) -> bool:
        return self.blocks_to_append(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: KVSequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        if not self.can_append(seq, num_new_tokens):
            raise RuntimeError(f"append_slots: sequence {seq.seq_id} needs "
                               f"{self.blocks_to_append(seq, num_new_tokens)} free blocks, "
                               f"{self.num_free_blocks} are free")
        copies = []
        for m, v in zip(self.groups, self._views(seq)):
            copies.extend(m.append_slots(v, num_new_tokens))
        return copies

    def trim(self, seq: KVSequence, num_tokens: int) -> int:
        return sum(m.trim(v, num_tokens) for m, v in zip(self.groups, self._views(seq)))

    def fork(self, parent: KVSequence, child: KVSequence) -> None:
        for m, p, c in zip(self.groups, self._views(parent), self._views(child)):
            m.fork(p, c)

    def register_computed_blocks(self, seq: KVSequence) -> None:
        for m, v in zip(self.groups, self._views(seq)):
            m.register_computed_blocks(v)

    def free(self, seq: KVSequence) -> None:
        for m, v in zip(self.groups, self._views(seq)):
            m.free(v)

    # ---- swap (kv/block_swap.py, group by group on the shared swap pool) -------------------------
    def can_swap_out(self, seq: KVSequence) -> bool:
        live = sum(len(m._computed_live(v)) for m, v in zip(self.groups, self._views(seq)))
        return live <= self.swap_pool.num_free

    def swap_out(self, seq: KVSequence, undo_copies: list[tuple[int, int]] = ()) -> bool:
        if not self.can_swap_out(seq):
            return False
        for m, v in zip(self.groups, self._views(seq)):
            assert m.swap_out(v, undo_copies)
        return True

    def can_swap_in(self, seq: KVSequence, num_new_tokens: int) -> bool:
        need = 0
        for m in self.groups:
            host = m.swapped[seq.seq_id]
            need += sum(h is not None for h in host) + max(0, m.blocks_for(seq.num_computed_tokens + num_new_tokens)
                                                           - len(host))
        return need <= self.num_free_blocks

    def swap_in(self, seq: KVSequence) -> None:
        for m, v in zip(self.groups, self._views(seq)):
            m.swap_in(v)

    def drop_swapped(self, seq: KVSequence) -> None:
        for m in self.groups:
            m.drop_swapped(seq)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        out, into = [], []
        for m in self.groups:
            o, i = m.take_transfers()
            out.extend(o)
            into.extend(i)
        return out, into

    # ---- whole cache ----------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.groups[0].reset_prefix_cache()  # the pool is shared: once is all of it

    def forget_prefix_cache(self) -> int:
        return self.groups[0].forget_prefix_cache()

    def stats(self) -> dict[str, float]:
        out = self.groups[0].stats()
        for key, name in (("evictions", "num_evictions"), ("copy_on_write", "num_copy_on_write"),
                          ("swapped_out_blocks", "num_swapped_out_blocks"),
                          ("swapped_in_blocks", "num_swapped_in_blocks"),
                          ("window_released_blocks", "num_window_released")):
            out[key] = self._sum(name)
        out["table_groups"] = len(self.groups)
        return out


class _Hits(list):
    """``match_prefix``'s answer: the full group's hits (so ``len`` is the hit in blocks, as with one table),
    with ``per_group``."""

    per_group: list[list]
