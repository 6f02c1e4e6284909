"""How the scheduler preempts a sequence when the KV cache is full: by recompute or by swapping its blocks
to the host tier (kv/tiers.py). Chosen on the rank (worker/kv_transfer.py measures the costs at start-up),
applied by the scheduler: plain data both sides import."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preemption:
    """How to preempt: ``mode`` "recompute" | "swap" | "auto". For auto, the measured costs (the runner's
    start-up measurement, turnout/worker/kv_transfer.py): swapping a sequence costs its blocks out and
    back in, ``2 * blocks * block_bytes / copy_bytes_per_s``; recomputing it costs
    ``num_computed_tokens / prefill_tokens_per_s``."""

    mode: str = "recompute"
    block_bytes: int = 0
    copy_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0

    def swap_pays(self, num_blocks: int, num_computed_tokens: int) -> bool:
        if self.mode != "auto":
            return self.mode == "swap"
        if self.copy_bytes_per_s <= 0 or self.prefill_tokens_per_s <= 0:
            return False
        swap_s = 2 * num_blocks * self.block_bytes / self.copy_bytes_per_s
        return swap_s < num_computed_tokens / self.prefill_tokens_per_s
