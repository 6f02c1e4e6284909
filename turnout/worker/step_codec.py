"""One engine step's model inputs as one flat int64 buffer: what the driver rank sends the other ranks of a
tensor-parallel engine each step (turnout/executor/multiproc.py). Plain integers, no per-request Python objects,
never pickled: a header, then ids, positions, slots, the block tables, sequence lengths, query starts and
the rows that sample (with several table groups, then their count, widths, slots and tables). Block copies (copy-on-write, and the KV tiers' swaps between the device and host caches)
go in messages of their own, since the driver runs them before it builds the step's inputs (and a step rebuilt
after a fault does not run them again)."""

from __future__ import annotations

import torch

from turnout.layers.attention import AttentionMetadata

STEP, COPY, RPC, QUIT = b"S", b"C", b"R", b"Q"
SWAP_OUT, SWAP_IN = b"O", b"I"  # KV tier copies (worker/kv_transfer.py): (device, host) / (host, device) pairs
_PAD = 8  # the kind byte is padded to 8 so that the int64 payload is aligned
_HEADER = 8  # n_tokens, n_seqs, max_blocks, n_sample, max_query_len, max_seq_len, has_lanes, pending


def _frame(kind: bytes, payload: torch.Tensor) -> bytes:
    return kind.ljust(_PAD, b"\0") + payload.numpy().tobytes()


def _payload(msg: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(msg[_PAD:]), dtype=torch.int64)


def kind_of(msg: bytes) -> bytes:
    return msg[:1]


def encode_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, sample_idx: list[int],
                has_lanes: bool, pending: bool) -> bytes:
    """Host tensors (as ModelRunner.prepare_host made them) -> one message."""
    n_seqs, max_blocks = meta.block_tables.shape
    header = torch.tensor([input_ids.shape[0], n_seqs, max_blocks, len(sample_idx), meta.max_query_len,
                           meta.max_seq_len, int(has_lanes), int(pending)], dtype=torch.int64)
    parts = [header, input_ids.long(), positions.long(), meta.slot_mapping.long(), meta.block_tables.long().flatten(),
             meta.seq_lens.long(), meta.query_start_loc.long(), torch.tensor(sample_idx, dtype=torch.int64)]
    if meta.group_tables is not None:  # table groups 1..: their count and widths, then slots and tables of each
        parts.append(torch.tensor([len(meta.group_tables)] + [int(b.shape[1]) for _, b in meta.group_tables]))
        parts.extend(x.long().flatten() for pair in meta.group_tables for x in pair)
    return _frame(STEP, torch.cat(parts))


def decode_step(msg: bytes):
    """One message -> (input_ids, positions, meta, sample_idx, has_lanes, pending), host tensors."""
    flat = _payload(msg)
    n_tok, n_seqs, max_blocks, n_sample, max_q, max_s, has_lanes, pending = flat[:_HEADER].tolist()
    sizes = [n_tok, n_tok, n_tok, n_seqs * max_blocks, n_seqs, n_seqs + 1, n_sample]
    end = _HEADER + sum(sizes)
    ids, pos, slots, tables, lens, qsl, sample = flat[_HEADER:end].split(sizes)
    meta = AttentionMetadata(slot_mapping=slots.clone(), block_tables=tables.view(n_seqs, max_blocks).int(),
                             seq_lens=lens.int(), query_start_loc=qsl.int(), max_query_len=max_q, max_seq_len=max_s,
                             seq_lens_host=tuple(lens.tolist()), query_start_loc_host=tuple(qsl.tolist()))
    if flat.shape[0] > end:  # table groups 1.. (the receiving rank sets meta.layer_group from its own layout)
        n_groups = int(flat[end])
        widths = flat[end + 1:end + 1 + n_groups].tolist()
        rest = flat[end + 1 + n_groups:].split([n for w in widths for n in (n_tok, n_seqs * w)])
        meta.group_tables = tuple((rest[2 * i].clone(), rest[2 * i + 1].view(n_seqs, w).int())
                                  for i, w in enumerate(widths))
    # has_lanes: 0 no logits, 1 logits, 3 logits from an eager forward (the driver records routing)
    return ids.clone(), pos.clone(), meta, sample.tolist(), int(has_lanes), bool(pending)


def encode_copy(copy_on_write, kind: bytes = COPY) -> bytes:
    """Block pairs: copy-on-write (COPY), or the KV tiers' swap-outs / swap-ins (SWAP_OUT / SWAP_IN)."""
    return _frame(kind, torch.tensor(list(copy_on_write), dtype=torch.int64).flatten())


def decode_copy(msg: bytes) -> list[tuple[int, int]]:
    pairs = _payload(msg).view(-1, 2).tolist()
    return [tuple(p) for p in pairs]
