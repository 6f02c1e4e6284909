"""Input processing: a request as the caller gives it -> an admitted ``EngineRequest``, or a ValueError
naming the field. Tokenising, the chat template and admission happen here and nowhere else.

Admission checks every value against what the engine can represent: token ids against the vocabulary,
the sampling parameters against the model (``SamplingParams.verify_for_model``), the length against the
context limit, and the request's cost against ``EngineConfig.max_tokens_per_request``. A request that
passes here must never make a step raise; if one still does, the engine core fails that request only.
No torch.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Protocol

from turnout.engine.sampling_params import SamplingParams


class ContextLengthError(ValueError):
    """The prompt (plus max_tokens) does not fit the context. ``param`` names the field to blame."""

    def __init__(self, prompt_len: int, max_tokens: int | None, max_model_len: int):
        self.prompt_len, self.max_tokens, self.max_model_len = prompt_len, max_tokens, max_model_len
        if max_tokens is None or prompt_len >= max_model_len:
            self.param = "prompt"
            msg = (f"prompt: this model's maximum context length is {max_model_len} tokens, but the prompt "
                   f"has {prompt_len} tokens")
        else:
            self.param = "max_tokens"
            msg = (f"max_tokens: this model's maximum context length is {max_model_len} tokens, but "
                   f"{prompt_len} prompt tokens + {max_tokens} max_tokens = {prompt_len + max_tokens} were "
                   f"requested")
        super().__init__(msg)


class Tokenizer(Protocol):
    """What input processing needs of a tokenizer (a transformers tokenizer has all of it)."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, conversation: list[dict], **kwargs) -> list[int]: ...


@dataclass(frozen=True)
class EngineRequest:
    """An admitted request: what the engine core and the output processor are given."""

    request_id: str
    prompt: str | None  # the text, where the caller gave one
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seed: int  # in [0, 2**63): the request's own seed, or one drawn from the engine's generator
    grammar: object | None = None  # structured output: the compiled grammar (xgrammar), shared by its samples


def request_cost(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """Tokens a request may cost: n x (prompt + max_tokens), plus n x max_tokens x (1 + logprobs) for the
    logprob entries it may return. No max_tokens: up to the context limit."""
    gen = params.max_tokens if params.max_tokens is not None else max(max_model_len - num_prompt_tokens, 0)
    cost = params.n * (num_prompt_tokens + gen)
    if params.logprobs is not None:
        cost += params.n * gen * (1 + params.logprobs)
    return cost


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 max_tokens_per_request: int | None, seed: int, *, stop_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids  # what ends a sequence: a grammar allows them once its text is complete
        self._compiler = None  # the GrammarCompiler, made at the first structured request
        self._compiler_lock = threading.Lock()  # the server may ask for it from its event loop's threads
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_tokens_per_request = max_tokens_per_request
        self._rng = random.Random(seed)

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; give token ids")
        return list(self.tokenizer.encode(prompt))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        """``template_kwargs`` go to the tokenizer's apply_chat_template: ``tools``, ``chat_template`` (a
        template other than the tokenizer's), and variables the template reads (``enable_thinking``)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]: each message needs 'role' and 'content'")
        if self.tokenizer is None or not (template_kwargs.get("chat_template")
                                          or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError("messages: this model has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, **template_kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                arrival_time: float) -> EngineRequest:
        """Tokenise and admit. ValueError naming the field if the request cannot be served as asked."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, ids = prompt, self.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError("prompt: must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt: must not be empty")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none")
        vocab = self.vocab_size
        params.verify_for_model(vocab)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len or (params.max_tokens is not None
                                              and len(ids) + params.max_tokens > self.max_model_len):
            raise ContextLengthError(len(ids), params.max_tokens, self.max_model_len)
        limit = self.max_tokens_per_request
        if limit is not None:
            cost = request_cost(len(ids), params, self.max_model_len)
            if cost > limit:
                gen = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
                lp = f" + logprob entries n x {gen} x (1 + {params.logprobs})" if params.logprobs is not None else ""
                raise ValueError(f"max_tokens_per_request: this request may cost {cost} tokens (n={params.n} x "
                                 f"({len(ids)} prompt + {gen} max_tokens){lp}), over the limit of {limit} "
                                 f"tokens a request; lower n, max_tokens or logprobs")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler().compile(params.structured_outputs)  # cached per spec
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return EngineRequest(request_id, text, ids, params, arrival_time, seed % 2**63, grammar)

    def grammar_compiler(self):
        """The engine's GrammarCompiler (turnout/structured/compiler.py): built once, from the tokenizer,
        for the logits' width (an LM head padded past the tokenizer never allows its padding ids)."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs: structured output needs the model's tokenizer, and this "
                             "model has none")
        with self._compiler_lock:
            if self._compiler is None:
                from turnout.structured.compiler import GrammarCompiler

                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                 stop_token_ids=sorted(self.stop_token_ids or ()) or None)
            return self._compiler

    def new_grammar_state(self, req: EngineRequest):
        """A fresh GrammarState for the request's first sequence (its other samples fork it), or None."""
        return None if req.grammar is None else self.grammar_compiler().new_state(req.grammar)
