"""What the engine core hands out: per step the tokens each sequence drew (``CoreOutput``, for the output
processor), and the engine's counters (``EngineStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from turnout.engine.sequence import Sequence


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    lookahead_steps_total: int = 0  # decode steps launched before the last one's tokens were read back
    draft_tokens_total: int = 0  # tokens proposed to multi-token steps (engine/drafts.py)
    accepted_draft_tokens_total: int = 0  # of those, kept (each saved one one-token step)
    num_drafts_total: int = 0  # (sequence, step) pairs that verified drafts
    draft_tokens_per_position: list[int] = field(default_factory=list)  # [j]: drafts verified at position j
    accepted_draft_tokens_per_position: list[int] = field(default_factory=list)  # [j]: of those, kept
    num_failed_requests_total: int = 0  # requests failed by a fault traced to them (the engine went on)
    # KV tiers (worker/kv_transfer.py, kv/tiers.py)
    num_swapped: int = 0  # sequences waiting in host memory to be swapped back in
    swap_preemptions_total: int = 0
    recompute_preemptions_total: int = 0
    swap_pool_full_total: int = 0  # swap chosen, the host pool full: recomputed instead
    swapped_out_blocks_total: int = 0
    swapped_in_blocks_total: int = 0
    host_tier_hit_tokens_total: int = 0  # prefix hits loaded back from host memory (in prefix_cache_hit_tokens_total)
    host_tier_offloaded_blocks_total: int = 0
    host_tier_used_blocks: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence got per step that verified drafts (1 + the drafts it kept; vLLM's definition);
        0.0 before any."""
        return 1.0 + self.accepted_draft_tokens_total / self.num_drafts_total if self.num_drafts_total else 0.0

    @property
    def draft_acceptance_per_position(self) -> list[float]:
        """[j]: the fraction of drafts at position j that were kept."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_draft_tokens_per_position,
                                                     self.draft_tokens_per_position)]


@dataclass
class SampledToken:
    """One sequence's new tokens of a step (1, or up to 1 + its drafts), appended to it already, with their
    logprobs where asked."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, the top-N (token, logprob)


@dataclass
class CoreOutput:
    sampled: list[SampledToken] = field(default_factory=list)
    forked: list[Sequence] = field(default_factory=list)  # new samples of n > 1 requests, before their tokens
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request_id, message) failed by a fault
    scheduled_request_ids: set[str] = field(default_factory=set)  # requests that computed in a launched step
    # per-request results besides tokens (prompt logprob chunks, routed experts), each with ``request_id``
    side_outputs: list = field(default_factory=list)
