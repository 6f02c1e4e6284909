"""Last-arrival: the last program of a group to finish its part does the group's epilogue, in the same kernel.

A reduction over programs (the slots of a token in the MoE down projection, the splits of a decode
attention) usually needs a second kernel that waits for the first. At batch-1 decode each kernel costs a
few microseconds of fixed time, so instead every program of the group, after storing its part, counts
itself on a device counter; the program that sees the count reach the group size is the last, reads the
other parts and writes the result. The sum order is fixed by the code, not by who is last, so results do
not depend on timing.

Protocol (``last_arrival``): every program of the group must arrive exactly once, including programs that
have nothing to store (or the counter never reaches the group size). The barrier makes the whole program's
stores precede the arrival; the atomic is acquire-release at GPU scope, so the last program sees every
part; it reads them with ``.cg`` loads (L2, never a stale L1 line). The last program resets the counter
to 0, so the counters are zero between kernels and one buffer per device serves every kernel of a stream
(with PDL the part of a kernel that touches counters runs only after the kernel before it completed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COUNTERS = 1 << 16
_BUFFERS: dict = {}


@triton.jit
def last_arrival(counter_ptr, group_size):
    """True in the last of ``group_size`` programs to call this on ``counter_ptr`` (which it resets)."""
    tl.debug_barrier()  # all of this program's stores come before its arrival
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = old == group_size - 1
    tl.store(counter_ptr, 0, mask=last)
    return last


def arrival_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """``n`` zeroed int32 counters on ``device`` (a buffer kept for the process), or None when ``n`` exceeds
    ``MAX_COUNTERS``: the caller then takes its two-kernel path. Made outside any graph capture (the first
    call of a kernel is the eager warm-up before capture)."""
    if n > MAX_COUNTERS:
        return None
    key = (device.type, device.index)
    buf = _BUFFERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("arrival counters must be made before CUDA graph capture")
        buf = _BUFFERS[key] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return buf
