"""Per-request state slots (recurrent layers' ``StateSpec``, kv/spec.py). Plain Python, no torch.

A state is not paged: a sequence holds one device slot from its first schedule to its end, whatever its
length. The block manager takes and frees slots beside the sequence's blocks, and swaps them with it: a
swapped-out sequence's state goes to a host slot it owns, and comes back into a fresh device slot, each copy
queued here (``take_transfers``) and run by the runner with the block copies, in the same order (every
device -> host copy first, host -> device ones before the forward).

A forked sequence would need its parent's state as it stands after the step that forks it, so a copy after
the forward: not built, and ``fork`` refuses it by name.
"""

from __future__ import annotations

from collections import deque


class StateSlots:
    def __init__(self, num_slots: int, num_host_slots: int = 0):
        if num_slots < 1 or num_host_slots < 0:
            raise ValueError(f"StateSlots: num_slots must be >= 1 and num_host_slots >= 0, got {num_slots}, "
                             f"{num_host_slots}")
        self.num_slots, self.num_host_slots = num_slots, num_host_slots
        self._free: deque[int] = deque(range(num_slots))
        self._host_free: deque[int] = deque(range(num_host_slots))
        self.slot_of: dict[int, int] = {}  # seq_id -> device slot
        self.swapped: dict[int, int] = {}  # seq_id -> host slot
        self._to_host: list[tuple[int, int]] = []
        self._to_device: list[tuple[int, int]] = []
        self._host_to_free: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def needs_slot(self, seq_id: int) -> bool:
        return seq_id not in self.slot_of

    def take(self, seq_id: int) -> int:
        if seq_id in self.slot_of:
            raise RuntimeError(f"state slots: sequence {seq_id} already holds slot {self.slot_of[seq_id]}")
        if not self._free:
            raise RuntimeError(f"state slots: none free for sequence {seq_id} ({self.num_slots} in all)")
        slot = self.slot_of[seq_id] = self._free.popleft()
        return slot

    def release(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def can_swap_out(self) -> bool:
        return bool(self._host_free)

    def swap_out(self, seq_id: int) -> bool:
        """Queue the sequence's state to a host slot and release its device slot; False (nothing done) when
        no host slot is free or it holds none."""
        if seq_id not in self.slot_of or not self._host_free:
            return False
        host = self._host_free.popleft()
        self._to_host.append((self.slot_of[seq_id], host))
        self.swapped[seq_id] = host
        self.release(seq_id)
        return True

    def swap_in(self, seq_id: int) -> None:
        host = self.swapped.pop(seq_id, None)
        if host is None:
            return
        slot = self.take(seq_id)
        self._to_device.append((host, slot))
        self._host_to_free.append(host)  # not reusable before this step's copies are queued

    def drop_swapped(self, seq_id: int) -> None:
        host = self.swapped.pop(seq_id, None)
        if host is not None:
            self._host_free.append(host)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """((device slot, host slot) to run first, (host slot, device slot) before the forward)."""
        out, into = self._to_host, self._to_device
        self._to_host, self._to_device = [], []
        self._host_free.extend(self._host_to_free)
        self._host_to_free = []
        return out, into
