"""What one scheduler step hands the engine: the sequences to compute and how far, the forks, the block
copies and the preemptions. No torch.

Plain data, apart from the ``Scheduler`` that fills it, because the engine core reads it and
engine/step_inputs.py turns it into the rank's typed step (worker/step.py) without needing the
scheduler's policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turnout.engine.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # = seq.num_computed_tokens before the step
    num_tokens: int  # compute seq.token_ids[start:start + num_tokens] this step
    sample: bool  # the chunk reaches the end of the sequence: sample from its last token's logits
    # proposed tokens computed after the chunk in the same forward (a multi-token step): the rank keeps the
    # ones its own draws confirm (worker/step.py); slots are reserved for all of them
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        """False for a decode: the one token sampled last step (prompt done, not a recompute)."""
        return self.num_tokens > 1 or self.start < self.seq.num_prompt_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # (index into `scheduled` of the parent, the new child): the child samples its first token from the
    # parent's logits row; the child is already running and holds references on the parent's blocks
    forks: list[tuple[int, Sequence]] = field(default_factory=list)
    copy_on_write: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies, before the forward
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    # host tier copies (kv/tiers.py gives the order): (device, host) before anything else of the step,
    # (host, device) after copy_on_write and before the forward
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
