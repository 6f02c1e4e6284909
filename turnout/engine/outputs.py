"""What generation returns, shaped as vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # one dict per generated token: token id -> Logprob (the sampled token and the top-N)
    logprobs: list[dict[int, Logprob]] | None = None
    # "stop" | "length" | "abort" | "error" (a fault traced to this request; stop_reason holds the
    # message) | None while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # return_routed_experts: int32 [num_prompt_tokens + len(token_ids) - 1, num_moe_layers, top_k] (numpy), the
    # experts chosen for every token the model read (turnout/worker/routed_experts.py); on finished outputs
    routed_experts: object | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = field(default=None)
    # set when a fault traced to this request ended it (every completion then has finish_reason
    # "error"): the message a server turns into an error for this client only
    error: str | None = None
