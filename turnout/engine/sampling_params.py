"""SamplingParams, as in vLLM. Every invalid value raises ValueError naming the field.

Admission is the one place a value is checked against what the engine can represent: each integer is
bounded by the dtype of the tensor it ends up in (top_k: int32, seeds and token ids: int64) and by its
meaning (counts), each float must be finite where NaN or infinity has no meaning. A value that passes
here must never make a step raise. Checks that need the model (the vocabulary) are in
``verify_for_model``, which admission calls once the model is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries, as OpenAI's limit on logit_bias (300) rounded up
LOGIT_BIAS_RANGE = 100.0  # OpenAI: values in [-100, 100]
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # any 64-bit pattern, signed or unsigned
MAX_TOKENS_LIMIT = INT32_MAX  # positions and lengths are int32 in the attention metadata


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite(x) -> bool:
    # an int too large for a float is not a usable number here either
    try:
        return _is_num(x) and math.isfinite(x)
    except OverflowError:
        return False


def _need(cond: bool, name: str, why: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {why}")


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off; at or above the vocabulary size: off too (verify_for_model)
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
    # token id -> bias added to its logit. Validated here (keys token ids, values finite in [-100, 100]);
    # the OpenAI server still refuses a non-empty one until the sampler applies it.
    logit_bias: dict[int, float] | None = None
    # per-request hooks, as vLLM's: fn(output_token_ids, logits [V] f32) -> logits [V], applied before
    # sampling (Python API only). One that raises fails its own request, never the step.
    logits_processors: list | None = None
    # structured output (vLLM's name and shape): a turnout.structured.StructuredOutputsParams, or a dict of
    # its fields; compiled against the vocabulary at admission (turnout/engine/input_processor.py)
    structured_outputs: object | None = None
    # vLLM's: for every prompt position after the first, the logprob of the prompt token there and the top-k
    # (RequestOutput.prompt_logprobs; None at position 0). Such a request bypasses the prefix cache.
    prompt_logprobs: int | None = None
    # MoE models: CompletionOutput.routed_experts, the expert ids select_experts chose in every MoE layer
    # for every token the model read (turnout/worker/routed_experts.py). Bypasses the prefix cache too.
    return_routed_experts: bool = False
    # False: no draft tokens for this request where the engine has a speculative_config (its output is the
    # same either way: turnout/engine/speculative.py); True (the default) drafts where the engine does
    speculative_decoding: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self):
        need = _need
        need(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}], got {_short(self.n)}")
        need(_finite(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature",
             f"must be a number in [0, 100], got {_short(self.temperature)}")
        need(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {_short(self.top_p)}")
        need(_is_int(self.top_k) and -1 <= self.top_k <= INT32_MAX, "top_k",
             f"must be -1, 0 (off) or a positive integer up to {INT32_MAX}, got {_short(self.top_k)}")
        need(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {_short(self.min_p)}")
        need(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX), "seed",
             f"must be an integer within 64 bits ([{SEED_MIN}, {SEED_MAX}]), got {_short(self.seed)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(_finite(v) and -2.0 <= v <= 2.0, name, f"must be in [-2, 2], got {_short(v)}")
        need(_finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0, "repetition_penalty",
             f"must be in (0, 10], got {_short(self.repetition_penalty)}")
        need(self.max_tokens is None or (_is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_TOKENS_LIMIT),
             "max_tokens", f"must be an integer in [1, {MAX_TOKENS_LIMIT}], got {_short(self.max_tokens)}")
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens <= MAX_TOKENS_LIMIT, "min_tokens",
             f"must be an integer in [0, {MAX_TOKENS_LIMIT}], got {_short(self.min_tokens)}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative_decoding"):
            need(isinstance(getattr(self, name), bool), name, f"must be a boolean, got {_short(getattr(self, name))}")
        need(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
             f"must be an integer in [0, {MAX_LOGPROBS}], got {_short(self.logprobs)}")
        need(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                              and 0 <= self.prompt_logprobs <= MAX_LOGPROBS), "prompt_logprobs",
             f"must be an integer in [0, {MAX_LOGPROBS}], got {_short(self.prompt_logprobs)}")
        need(isinstance(self.return_routed_experts, bool), "return_routed_experts",
             f"must be a boolean, got {_short(self.return_routed_experts)}")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop if self.stop is not None else [])
        need(isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop), "stop",
             "must be a non-empty string or a list of non-empty strings")
        need(len(stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        need(all(len(s) <= MAX_STOP_STRING_CHARS for s in stop), "stop",
             f"each stop string at most {MAX_STOP_STRING_CHARS} characters")
        self.stop_strings = tuple(stop)
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        need(isinstance(ids, (list, tuple)), "stop_token_ids", "must be a list of non-negative integers")
        need(len(ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        bad = next((t for t in ids if not (_is_int(t) and 0 <= t <= INT64_MAX)), None)
        need(bad is None, "stop_token_ids", f"must be a list of non-negative integers within int64, got {_short(bad)}")
        self.stop_token_ids = list(ids)
        need(self.logits_processors is None or (isinstance(self.logits_processors, (list, tuple))
                                                and all(callable(f) for f in self.logits_processors)),
             "logits_processors", "must be a list of callables fn(output_token_ids, logits) -> logits")
        if self.structured_outputs is not None:
            from turnout.structured.params import StructuredOutputsParams

            so = self.structured_outputs
            if isinstance(so, dict):  # errors name structured_outputs.<field>
                bad = next((k for k in so if k not in StructuredOutputsParams.__dataclass_fields__
                            or k == "field_names"), None)
                need(bad is None, "structured_outputs", f"unknown field {_short(bad)}")
                so = StructuredOutputsParams(**so, field_names={k: f"structured_outputs.{k}" for k in so})
            need(isinstance(so, StructuredOutputsParams), "structured_outputs",
                 f"must be a StructuredOutputsParams (or a dict of its fields), got {type(so).__name__}")
            self.structured_outputs = so
        if self.logit_bias is not None:
            lb = self.logit_bias
            need(isinstance(lb, dict), "logit_bias", "must be a mapping of token id to bias")
            need(len(lb) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(lb)}")
            for k, v in lb.items():
                need(_is_int(k) and 0 <= k <= INT64_MAX, "logit_bias",
                     f"keys must be non-negative integer token ids, got {_short(k)}")
                need(_finite(v) and -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE, "logit_bias",
                     f"values must be finite numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                     f"got {_short(v)} for token {k}")
            self.logit_bias = {int(k): float(v) for k, v in lb.items()}

    def verify_for_model(self, vocab_size: int) -> None:
        """The checks that need the model: every token id inside [0, vocab_size), else ValueError naming
        the field. ``top_k`` at or above the vocabulary keeps every token: it is normalised to 0 (off), so
        the sampler never sees a k it cannot represent or use. Idempotent; called once per request."""
        _need(_is_int(vocab_size) and vocab_size > 0, "vocab_size", f"must be a positive integer, got {vocab_size!r}")
        bad = next((t for t in self.stop_token_ids if not 0 <= t < vocab_size), None)
        _need(bad is None, "stop_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        if self.logit_bias:
            bad = next((t for t in self.logit_bias if not 0 <= t < vocab_size), None)
            _need(bad is None, "logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        if self.top_k >= vocab_size:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def skip_prefix_cache(self) -> bool:
        """Every prompt position must be computed (its logits or its routing are returned)."""
        return self.prompt_logprobs is not None or self.return_routed_experts

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
