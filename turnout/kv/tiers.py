"""The host tier of the KV cache: which host blocks hold what. Plain Python, no torch (the runner's
turnout/worker/kv_transfer.py owns the host tensors and moves the bytes).

Host block ids index one host cache per layer (k and v, ``[num_host_blocks, block_size, Hk, D]``, pinned on
GPUs). They are split in two regions:

- the **swap pool** ``[0, swap_blocks)``: blocks of sequences preempted by swapping, owned by the sequence
  until it is swapped back in (or ends);
- the **prefix tier** ``[swap_blocks, swap_blocks + offload_blocks)``: full, registered prefix blocks
  evicted from the device prefix cache, least recently used given away first. An entry is named by the
  same hash chain as on the device (``block_hash(parent hash, token ids)``, kv/block_manager.py), and a hit
  is checked against the stored parent hash and token ids too, as on the device.

Copy order (the block manager queues the copies, the runner runs them in this order at the start of the
step): every device -> host copy first (swap-outs and evictions read the content the blocks had when the
step was scheduled), then copy-on-write, then host -> device (swap-ins and prefix loads), then the forward.
A prefix-tier entry being loaded in a step is pinned for that step, so an eviction in the same step can
never overwrite it before its copy has read it.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class HostBlockPool:
    """Free list of the swap region's host block ids."""

    def __init__(self, num_blocks: int, base: int = 0):
        if num_blocks < 0:
            raise ValueError(f"HostBlockPool: num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(base, base + num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` host block ids, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(ids)


class HostEntry:
    __slots__ = ("host_id", "parent_hash", "token_ids")

    def __init__(self, host_id: int, parent_hash: int | None, token_ids: tuple[int, ...]):
        self.host_id, self.parent_hash, self.token_ids = host_id, parent_hash, token_ids


class HostPrefixCache:
    """LRU prefix blocks in host memory, keyed by their hash chain."""

    def __init__(self, num_blocks: int, base: int = 0):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(base, base + num_blocks))
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()  # hash -> entry, least recently used first
        self._pinned: set[int] = set()  # hashes loaded in the step being scheduled
        self.num_offloaded = 0  # blocks copied in (device evictions)
        self.num_evicted = 0  # entries given away for newer ones
        self.num_hits = 0  # blocks found and loaded back

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def __contains__(self, h: int) -> bool:
        return h in self._entries

    def lookup(self, h: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> int | None:
        """The host block holding this block, or None. No state changes."""
        e = self._entries.get(h)
        if e is None or e.parent_hash != parent_hash or e.token_ids != token_ids:
            return None
        return e.host_id

    def pin(self, h: int) -> None:
        """Keep ``h`` for this step (it is being loaded) and mark it recently used."""
        self._entries.move_to_end(h)
        self._pinned.add(h)
        self.num_hits += 1

    def unpin_all(self) -> None:
        self._pinned.clear()

    def offload(self, h: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> int | None:
        """Make room for an evicted device block: the host block to copy it into, or None when no copy is
        needed (already here: it was loaded from here, or offloaded before) or no entry can be given away
        (all pinned)."""
        if h in self._entries:
            self._entries.move_to_end(h)
            return None
        if self._free:
            host_id = self._free.popleft()
        else:
            victim = next((k for k in self._entries if k not in self._pinned), None)
            if victim is None:
                return None
            host_id = self._entries.pop(victim).host_id
            self.num_evicted += 1
        self._entries[h] = HostEntry(host_id, parent_hash, token_ids)
        self.num_offloaded += 1
        return host_id

    def clear(self) -> int:
        """Forget every entry (after a weight update). Returns how many were forgotten."""
        n = len(self._entries)
        for e in self._entries.values():
            self._free.append(e.host_id)
        self._entries.clear()
        self._pinned.clear()
        return n


class HostHit:
    """A prefix-cache hit in the host tier (``BlockManager.match_prefix`` lists these among device ids)."""

    __slots__ = ("host_id", "hash", "parent_hash", "token_ids")

    def __init__(self, host_id: int, h: int, parent_hash: int | None, token_ids: tuple[int, ...]):
        self.host_id, self.hash, self.parent_hash, self.token_ids = host_id, h, parent_hash, token_ids

    def __repr__(self) -> str:
        return f"HostHit(host={self.host_id})"
