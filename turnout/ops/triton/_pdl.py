"""Programmatic dependent launch (PDL) for the kernels of a decode step, on NVIDIA GPUs from sm90 (Hopper).

A batch-1 decode step is a chain of ~500 small kernels, and each pays a fixed cost at its start (launch,
first loads in flight) that no kernel tuning removes. Launched with PDL, a kernel may start while the one
before it in the stream is still running. Every kernel that takes part follows one protocol:

1. before ``pdl_wait`` it reads only constants (weights), never an activation, input or output buffer;
2. every program calls ``pdl_wait`` (``gdc_wait``: returns once the previous kernel has completed and its
   writes are visible), including programs that exit early, before touching any other memory. So a
   kernel never completes before the one it follows, and completion order stays the stream order,
   transitively through the chain;
3. ``pdl_wait`` then calls ``gdc_launch_dependents``: the next kernel may start launching now. A kernel
   named in ``TURNOUT_PDL_EARLY`` (or in ``EARLY_DEFAULT``) calls it *before* its wait instead, so the next
   kernel launches while this one still waits and can read its constants (weights) during the wait. The
   order argument still holds: the next kernel's own wait returns only once this kernel has completed,
   which is after this kernel's wait returned. A grid's dependent launches only once every program of the
   grid has started (triggered or exited), so a kernel launched early cannot take the SMs that a kernel
   it waits for still needs.

Kernels that do not take part (cuBLAS, torch's own ops, the sampler) are launched normally, and a normal
launch waits for everything before it. ``TURNOUT_PDL=0`` turns it off (then ``PDL`` is 0 and the
kernels compile exactly as before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnout import envs
from turnout.platforms.platform import triton_pdl_enabled

try:  # Triton >= 3.3 (NVIDIA backend)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton or another backend: PDL stays off
    gdc_launch_dependents = gdc_wait = None


EARLY_ENV = "TURNOUT_PDL_EARLY"
# Kernels that let their dependent launch before they wait (rule 3): none. Measured in the captured
# Qwen3-30B-A3B step on the H200 (docs/benchmarks.md, "fewer round trips in decode attention"), every choice lost
# 0.8-3.4 %: with the split merge early, o_proj reads its weights during decode attention, and attention slows by
# more than o_proj gains.
EARLY_DEFAULT = frozenset()
KERNEL_NAMES = envs.PDL_KERNEL_NAMES  # declared in turnout/envs.py, which validates TURNOUT_PDL_EARLY against it


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """PDL: 0 off, 1 wait then let the dependent launch, 2 let the dependent launch, then wait."""
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (the one answer the engine also gets, from its platform)."""
    return triton_pdl_enabled(device)


def early_kernels() -> frozenset:
    """The kernel names that launch their dependent before waiting: ``TURNOUT_PDL_EARLY`` (comma-separated
    names from ``KERNEL_NAMES``; empty: none) when set, else ``EARLY_DEFAULT``."""
    names = envs.get().pdl_early  # validated against KERNEL_NAMES by turnout.envs
    return EARLY_DEFAULT if names is None else names


def pdl_args(t: torch.Tensor, kernel: str | None = None) -> dict:
    """Launch keyword arguments for a kernel with a ``PDL: tl.constexpr`` parameter, on t's device; ``kernel``
    (one of ``KERNEL_NAMES``) lets it launch its dependent before it waits when named early."""
    if kernel is not None and kernel not in KERNEL_NAMES:
        raise ValueError(f"pdl_args: unknown kernel name {kernel!r}; add it to KERNEL_NAMES")
    if pdl_enabled(t.device):
        return {"PDL": 2 if kernel is not None and kernel in early_kernels() else 1, "launch_pdl": True}
    return {"PDL": 0}
