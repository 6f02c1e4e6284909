"""The decode graphs' static inputs and how a step's inputs reach them (worker/cuda_graphs.py replays them).

Separate from capture and replay because this is its own problem: the layout of one device buffer that
every bucket's graph reads, and getting each step's host inputs into it in one copy without racing the
step before. Buffers, shared by all buckets (bucket ``b`` uses rows ``[:b]``):
``input_ids`` [max_bs]; ``positions``, ``slot_mapping`` (int64), ``seq_lens`` [max_bs] and ``block_tables``
[max_bs, max_blocks_per_seq], views of one int32 buffer in that order; ``query_start_loc`` [max_bs + 1] = 0,
1, 2, ... (one token a lane, never changes), and one per multi-token query length q (0, q, 2q, ...).

Several table groups (turnout/kv/spec.py: table groups): each group after the first has its own ``slot_mapping``
(int64, after group 0's, before ``seq_lens``) and ``block_tables`` (after group 0's), ``group_tables``; the
step's copy is then one range up to group 0's last live table row, and one range per further group (its
live rows). With one group the layout and the single copy are exactly as above.

A step's inputs go up in one copy: the host fills a pinned buffer of the same layout (two, used in turn), a
side stream copies it to a device staging buffer (two) while the previous step still runs, and the step
itself makes one device-to-device copy before the replay (four separate host-to-device copies would wait
in line, ~3 µs each of the step's GPU timeline). The copy covers the 1-D inputs of every row and the
block-table rows of the live lanes; other block-table rows keep earlier (valid) block ids.

Padding lanes (rows ``n .. b-1`` of a batch of ``n`` replayed in bucket ``b``) write nowhere (slot -1) and
attend to one token of block 0 (seq_len 1, a valid block id): finite garbage that nobody reads. The
invariant: every row at or beyond the last live batch size holds padding values; each pinned buffer
re-pads the rows it held live before and does not now, and its copy carries them.
"""

from __future__ import annotations

import torch

from turnout.layers.attention import AttentionMetadata


class StaticInputs:
    """The device buffers a captured graph reads, their pinned host twins and the upload; see the module docstring."""

    def __init__(self, max_bs: int, max_blocks: int, device: torch.device, upload_stream, query_lens,
                 num_groups: int = 1):
        self.max_bs, self.max_blocks = max_bs, max_blocks
        self.num_extra = num_groups - 1  # table groups after the first
        bs, dev = max_bs, device
        cuda = dev.type == "cuda"
        self._upload = upload_stream if cuda else None
        self.device = dev
        with torch.inference_mode():
            self.input_ids = torch.zeros(bs, dtype=torch.long, device=dev)
            self._inputs = torch.empty(self._size, dtype=torch.int32, device=dev)
            views = self._views(self._inputs)
            self.positions, self.slot_mapping, self.seq_lens, self.block_tables = views[:4]
            self.group_tables = views[4]  # ((slot_mapping, block_tables) of table groups 1..)
            self.query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=dev)
            self.multi_qsl = {q: torch.arange(0, (bs // q + 1) * q, q, dtype=torch.int32, device=dev)
                              for q in query_lens}
            # pinned host buffers and device staging buffers, two of each, used in turn
            self._host = [torch.empty(self._size, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
            self._staging = [torch.empty_like(self._inputs) for _ in range(2)] if self._upload is not None else []
            self._host_views = [self._views(buf) for buf in self._host]
            for views in self._host_views:
                self._pad(views, 0)
            self._inputs.copy_(self._host[0])
        self._host_filled = [0, 0]  # rows [0, k) of pinned buffer i may hold live values; rows beyond, padding
        self._uploaded = [torch.cuda.Event() for _ in range(2)] if cuda else []  # staging i written
        self._consumed = [torch.cuda.Event() for _ in range(2)] if cuda else []  # staging i read
        self._turn = 0

    @property
    def _flat(self) -> int:
        """int32 words of the 1-D inputs: positions, slots, each further group's slots (int64), seq_lens."""
        return (5 + 2 * self.num_extra) * self.max_bs

    @property
    def _size(self) -> int:
        return self._flat + (1 + self.num_extra) * self.max_bs * self.max_blocks

    def _words(self, rows: int) -> int:
        """int32 words of the inputs buffer up to the end of group 0's block-table row ``rows``."""
        return self._flat + rows * self.max_blocks

    def _ranges(self, rows: int) -> list[tuple[int, int]]:
        """The word ranges a step of ``rows`` sequences copies: one with one table group."""
        out = [(0, self._words(rows))]
        for g in range(1, 1 + self.num_extra):
            start = self._flat + g * self.max_bs * self.max_blocks
            out.append((start, start + rows * self.max_blocks))
        return out

    def _views(self, buf: torch.Tensor):
        """(positions i64 [bs], slot_mapping i64 [bs], seq_lens i32 [bs], block_tables i32 [bs, max_blocks],
        ((slot_mapping, block_tables) of each further table group))."""
        bs, mb, e = self.max_bs, self.max_blocks, self.num_extra
        slots = [buf[2 * bs * (1 + k):2 * bs * (2 + k)].view(torch.int64) for k in range(1 + e)]
        lens_at = (4 + 2 * e) * bs
        tables = [buf[self._flat + g * bs * mb:self._flat + (g + 1) * bs * mb].view(bs, mb) for g in range(1 + e)]
        return (buf[:2 * bs].view(torch.int64), slots[0], buf[lens_at:lens_at + bs], tables[0],
                tuple(zip(slots[1:], tables[1:])))

    @staticmethod
    def _pad(views, start: int, stop: int | None = None) -> None:
        positions, slots, seq_lens, tables, groups = views
        positions[start:stop] = 0
        slots[start:stop] = -1
        seq_lens[start:stop] = 1
        for g_slots, _ in groups:
            g_slots[start:stop] = -1
        if start == 0 and stop is None:
            tables.zero_()
            for _, g_tables in groups:
                g_tables.zero_()

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, b: int) -> None:
        """A step's inputs (on the host, pinned; input_ids may be on the device) into the static buffers, for
        a replay in bucket ``b`` of query length ``meta.max_query_len``, queued on the current stream."""
        t, n, q = int(input_ids.shape[0]), int(meta.seq_lens.shape[0]), meta.max_query_len
        width = int(meta.block_tables.shape[1])
        i = self._turn
        self._turn ^= 1
        host = self._host[i]
        if self._uploaded:
            self._uploaded[i].synchronize()  # the copy that last read this pinned buffer (two steps ago) is done
        positions_h, slots_h, seq_lens_h, tables_h, groups_h = views = self._host_views[i]
        positions_h[:t] = positions
        slots_h[:t] = meta.slot_mapping
        for (g_slots, g_tables), (slots, tables) in zip(groups_h, meta.group_tables or ()):
            g_slots[:t] = slots
            g_tables[:n, :tables.shape[1]] = tables
        seq_lens_h[:n] = meta.seq_lens
        if q > 1:
            seq_lens_h[n:b] = q  # padding sequences of q tokens
        # Columns beyond `width` keep stale (valid) block ids: kernels read only ceil(seq_len / block_size).
        tables_h[:n, :width] = meta.block_tables
        filled = max(t, b) if q > 1 else n  # rows (token or sequence) holding other than padding values
        if filled < self._host_filled[i]:  # re-pad the rows this buffer held live before and does not now
            self._pad(views, filled, self._host_filled[i])
        self._host_filled[i] = filled
        ranges = self._ranges(n)  # one range with one table group
        if self._upload is not None:  # up on the side stream, in one device-to-device copy here (one per group)
            main = torch.cuda.current_stream(self.device)
            staging = self._staging[i]
            with torch.cuda.stream(self._upload):
                self._upload.wait_event(self._consumed[i])  # the step that last read staging i has copied it
                for a, z in ranges:
                    staging[a:z].copy_(host[a:z], non_blocking=True)
                self._uploaded[i].record(self._upload)
            main.wait_event(self._uploaded[i])
            for a, z in ranges:
                self._inputs[a:z].copy_(staging[a:z], non_blocking=True)
            self._consumed[i].record(main)
        else:
            for a, z in ranges:
                self._inputs[a:z].copy_(host[a:z], non_blocking=True)
            if self._uploaded:
                self._uploaded[i].record()
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
