"""The step contract between the engine and a rank, as vLLM v1 splits them: per step the engine sends a
``SchedulerOutput`` (plain data per request: the tokens to compute and where, the blocks they live in,
drafts to verify, how to sample) and gets back a ``ModelRunnerOutput`` (per request: the tokens it
accepted, their logprobs). The engine's ``Sequence`` objects never cross: the rank keeps what it needs of a
request (its prompt, its sampling constants) from the ``NewRequest`` it was sent once, until the request id
comes back in ``finished_req_ids``.

A request id here is one sample's id (``Sequence.seq_id``): the n samples of a request are n ids, each
with its own seed. ``request_id``/``index`` name the user's request and sample, for the per-request side
outputs (prompt logprobs, routed experts).

Multi-token steps: an entry may carry ``draft_token_ids``, k tokens computed after its ``token_ids`` in the
same forward. The rank samples at each of the k + 1 positions (the draw at output step s uses the request's
seed and s, so it is what k + 1 one-token steps would draw), accepts the longest prefix of drafts equal to
its own draws, and returns those drafts plus its next draw: 1..k + 1 tokens. Exact for drafts that do not
depend on the rank's randomness: a draft is kept iff the target drew it.

Per-request callables (logits processors) and grammar states ride in the sampling part: only the rank
that samples (the driver, in the engine's process) ever reads them; the other ranks of a tensor-parallel
engine get the step's flat inputs (worker/step_codec.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class SamplingSpec:
    """A request's sampling constants, as the engine admitted them (the rank makes each fit its tensor)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    min_tokens: int = 0
    min_tokens_banned: tuple[int, ...] = ()  # ids forbidden while fewer than min_tokens were drawn (EOS, stops)
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    has_penalties: bool = False
    logprobs: int | None = None  # top-N logprobs per drawn token (0: the drawn one only); None: none
    logits_processors: tuple[Callable, ...] = ()


@dataclass
class NewRequest:
    """A request id the rank has not seen yet (or has seen finished): what it keeps of it."""

    req_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    prompt_logprobs: int | None = None  # top-k of the prompt positions' logprobs; None: not asked
    return_routed_experts: bool = False


@dataclass
class ScheduledRequest:
    """One request's work in a step: compute ``num_tokens`` tokens from position ``start``, then its drafts."""

    req_id: int
    start: int
    num_tokens: int
    token_ids: list[int] | None  # None: a lookahead step's one token, the rank's last draw, still on its device
    block_ids: tuple[list[int], ...]  # per KV cache group: the request's whole block table
    sample: bool  # the chunk reaches the end of what is known: draw from its last position (and its drafts')
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_query_tokens(self) -> int:
        """Positions computed in the forward: the tokens and the drafts."""
        return self.num_tokens + len(self.draft_token_ids)


@dataclass
class SampleRequest:
    """A token to draw (1 + the drafts of its row): ``row`` indexes the entries that sample, in order;
    a fork child draws from its parent's row (its own seed)."""

    req_id: int
    row: int
    num_output_tokens: int  # tokens drawn before this one (with a lookahead's pending one): the seeded step
    output_token_ids: list[int] | None = None  # for penalties and logits processors only
    grammar: Any = None  # structured output: the sample's state (layers.sampler.GrammarState)


@dataclass
class SchedulerOutput:
    """One step for a rank. Block copies run first: ``copy_on_write``, then ``swap_in`` (host -> device,
    passed layer by layer by the forward); swap-outs are sent on their own before the step is built."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    samples: list[SampleRequest] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_req_ids: list[int] = field(default_factory=list)
    copy_on_write: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    want_logprobs: int = -1  # the most top-N logprobs a sample asks for; -1: none asks
    lookahead: bool = False  # one token per entry, the rank's last draws (``ScheduledRequest.token_ids`` None)
    defer_sample: bool = False  # launch the forward only; ``StepHandle.sample()`` draws once grammars caught up


@dataclass
class ModelRunnerOutput:
    """A step's draws, per request id that drew (``req_ids``, in ``SchedulerOutput.samples`` order less the
    faulty ones): the accepted tokens, 1..k + 1 with k drafts, and where asked their logprobs."""

    req_ids: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] | None = None  # per accepted token: its logprob
    ranks: list[list[int]] | None = None  # its rank (1 = most likely)
    top: list[list[list[tuple[int, float]]]] | None = None  # the top-N (token, logprob), best first
    faults: dict[int, BaseException] = field(default_factory=dict)  # req_id -> what failed it (it drew nothing)


class RequestFaults(Exception):
    """A step stage traced exceptions to particular requests before any device work of the forward:
    ``faults`` maps req_id -> the exception. The engine fails those requests and sends the step again
    without them."""

    def __init__(self, faults: dict[int, BaseException]):
        self.faults = faults
        first = next(iter(faults.values()), None)
        super().__init__(f"{len(faults)} request(s) failed: {type(first).__name__}: {first}")
