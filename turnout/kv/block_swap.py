"""Swap preemption to the host pool (kv/tiers.py ``HostBlockPool``): the block manager's half. Plain Python, no torch.

``swap_out`` copies a preempted sequence's computed blocks (the live ones: a sliding window's released
entries stay null) to host blocks it then owns, with its per-request state slot if it has one, and frees its
device blocks; ``swap_in`` gives it fresh device blocks and queues the copies back. The copies are queued and
handed to the runner by ``take_transfers`` in the order kv/tiers.py gives.
"""

from __future__ import annotations

from turnout.kv.block_pool import KVSequence


class HostSwap:
    """The swap methods of ``BlockManager`` (kv/block_manager.py), which holds the state they use: the tables,
    the block pool, ``swap_pool``, ``swapped`` and ``states``."""

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
