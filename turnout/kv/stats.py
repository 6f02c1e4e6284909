"""The KV tiers' counters as a report: what a benchmark ran through (the ``*_total`` counters of
``LLMEngine.get_stats()`` as the difference over the measured part) and where things stand at its end
(the gauges), with the preemption mode and swap op in force. Plain Python: ``turnout bench`` and
``benchmarks/multiturn.py`` print it, and its keys are EngineStats' own names (stable JSON keys)."""

from __future__ import annotations

TOTALS = ("swap_preemptions_total", "recompute_preemptions_total", "swap_pool_full_total", "swapped_out_blocks_total",
          "swapped_in_blocks_total", "host_tier_hit_tokens_total", "host_tier_offloaded_blocks_total")
GAUGES = ("num_swapped", "host_tier_used_blocks")


def tier_report(stats, before=None, transfer=None) -> dict:
    """``stats`` (and ``before``, the same object at the start of the measured part) are EngineStats;
    ``transfer`` the runner's KVTransfer (its mode, swap strategy, pool sizes, ops dropped on failure)."""
    r = {k: getattr(stats, k) - (getattr(before, k) if before is not None else 0) for k in TOTALS}
    r.update({k: getattr(stats, k) for k in GAUGES})
    if transfer is not None:
        r.update({"preemption_mode": transfer.mode,
                  "swap_strategy": transfer.strategy[0] if transfer.strategy else None,
                  "swap_pool_blocks": transfer.num_swap_blocks, "host_tier_blocks": transfer.num_offload_blocks,
                  "swap_ops_failed": sorted(transfer.failed)})
    return r


def format_tiers(r: dict) -> str:
    """One line for a report table."""
    return (f"preemption {r.get('preemption_mode', '-')} (swap ops: {r.get('swap_strategy') or 'none'}); "
            f"{r['swap_preemptions_total']} swap / {r['recompute_preemptions_total']} recompute preemptions, "
            f"{r['swap_pool_full_total']} pool full; blocks {r['swapped_out_blocks_total']} out, "
            f"{r['swapped_in_blocks_total']} in; host tier {r['host_tier_hit_tokens_total']} hit tokens, "
            f"{r['host_tier_offloaded_blocks_total']} blocks offloaded, {r['host_tier_used_blocks']} used")
