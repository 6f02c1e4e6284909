"""One sequence being generated: its tokens, its KV blocks, where it stands. Plain Python, no torch.

A request with ``n`` samples starts as ONE sequence (``index`` 0, ``n`` = samples still to fork). Its
prompt is prefilled once; when the chunk that completes the prompt is scheduled, the scheduler forks
``n - 1`` children that share the parent's KV blocks (see ``Scheduler.schedule``). From then on every
sample is an independent ``Sequence`` with the same ``request_id`` and its own ``index``.

The engine's per-sample state (text, logprobs) lives in the output processor, keyed by request id and
``index``; a sample's grammar state (structured output) hangs here, as the scheduler side owns it.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from turnout.engine.sampling_params import SamplingParams
    from turnout.layers.sampler import GrammarState

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / phi: spreads the per-sample seeds of one request apart


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # preempted by swapping: its computed KV is in host blocks (kv/tiers.py)
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # a fault traced to this request (the engine went on without it)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's ``finish_reason`` string: "stop" | "length" | "abort", None while unfinished."""
        return _FINISH_REASON.get(self)


_FINISHED = frozenset({SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED,
                       SequenceStatus.FINISHED_ERROR})
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


class Sequence:
    """Token state and KV bookkeeping of one sample.

    Invariants the scheduler keeps: ``num_cached_tokens <= num_computed_tokens <= num_tokens``;
    ``block_table`` (with several table groups, each of ``block_tables``) covers at least the first ``num_computed_tokens`` tokens; the tokens still to compute
    are ``token_ids[num_computed_tokens:]`` (the prompt's tail while prefilling, one sampled token while
    decoding, prompt + output after a preemption).
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None,
        seed: int,
        n: int = 1,
        arrival_time: float = 0.0,
        index: int = 0,
    ):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must have at least one token")
        if n < 1:
            raise ValueError(f"request {request_id!r}: n must be >= 1, got {n}")
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params  # the scheduler side reads only ``max_tokens`` (None in scheduler-only tests)
        self.seed = seed
        self.n = n  # samples still to fork at the end of prefill, counting this one (1 = none)
        self.arrival_time = arrival_time
        self.index = index  # which of the request's n samples
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prefix-cache hits at the first schedule
        self.block_table: list[int] = []
        # the tables of table groups 1.. (kv/group_blocks.py; empty with one table group): block_table is group 0's
        self.group_tables: list[list[int]] = []
        self.num_preemptions = 0
        # structured output: each sample its own state (a fork gets a copy); its mask is a stage of the
        # sampler, and the core advances it with each token drawn
        self.grammar: GrammarState | None = None
        # prompt_logprobs / routed experts need every position computed: no prefix-cache hits (kv/block_manager.py)
        self.skip_prefix_cache = params is not None and getattr(params, "skip_prefix_cache", False)

    @property
    def block_tables(self) -> tuple[list[int], ...]:
        """One block table per table group (kv/spec.py: table groups): ``block_table``, then ``group_tables``."""
        return (self.block_table, *self.group_tables) if self.group_tables else (self.block_table,)

    # ---- tokens ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill_done(self) -> bool:
        """True once the whole prompt has been computed (it may need recomputing after a preemption)."""
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def max_tokens(self) -> int | None:
        return None if self.params is None else self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    # ---- samples --------------------------------------------------------------------------------
    def fork(self, new_seq_id: int, index: int) -> Sequence:
        """A sibling sample: same tokens, same computed KV, a copy of the block table (the caller must
        also take a reference on every block: ``BlockManager.fork``), a seed derived from this one."""
        # Built field by field so that state the engine hung on the parent is not shared by accident.
        child = Sequence(new_seq_id, self.request_id, self.prompt_token_ids, self.params,
                         (self.seed + index * _GOLDEN) % 2**63, 1, self.arrival_time, index)
        child.token_ids = list(self.token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_table = list(self.block_table)
        child.group_tables = [list(t) for t in self.group_tables]
        child.grammar = None if self.grammar is None else self.grammar.fork()
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}#{self.index}, {self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )
