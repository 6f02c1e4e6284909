"""SamplingParams, as in vLLM. Every invalid value raises ValueError naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self):
        def need(cond, name, why):
            if not cond:
                raise ValueError(f"{name}: {why}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        need(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        need(is_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature",
             f"must be a number in [0, 100], got {self.temperature!r}")
        need(is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        need(is_int(self.top_k) and self.top_k >= -1, "top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        need(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        need(self.seed is None or is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(is_num(v) and -2.0 <= v <= 2.0, name, f"must be in [-2, 2], got {v!r}")
        need(is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0, "repetition_penalty",
             f"must be in (0, 10], got {self.repetition_penalty!r}")
        need(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
             f"must be a positive integer, got {self.max_tokens!r}")
        need(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
             f"must be a non-negative integer, got {self.min_tokens!r}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        need(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
             f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        need(isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop), "stop",
             "must be a non-empty string or a list of non-empty strings")
        need(len(stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        self.stop_strings = tuple(stop)
        ids = self.stop_token_ids or []
        need(isinstance(ids, (list, tuple)) and all(is_int(t) and t >= 0 for t in ids), "stop_token_ids",
             "must be a list of non-negative integers")
        self.stop_token_ids = list(ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
