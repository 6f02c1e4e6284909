"""Grammars compiled against the model's vocabulary, once per distinct constraint.

``GrammarCompiler`` wraps xgrammar's compiler for one tokenizer. ``compile(params)`` is thread-safe and
compiles each canonical constraint (``StructuredOutputsParams.cache_key``) once: concurrent callers with
the same key wait for the one compilation in flight; a finished one is kept in an LRU of ``cache_size``
grammars. It blocks (a large schema takes tens of milliseconds), so an event loop calls
``compile_async``, which runs it on a worker thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from turnout.structured.grammar import build_grammar, clean_error
from turnout.structured.matcher import GrammarState
from turnout.structured.params import StructuredOutputsParams


@dataclass
class CacheInfo:
    hits: int
    misses: int
    size: int


class GrammarCompiler:
    """``tokenizer``: a Hugging Face tokenizer. ``vocab_size``: the width of the model's logits (an LM head
    is often padded past the tokenizer's vocabulary; the padding ids are never allowed). ``stop_token_ids``:
    the ids that end a sequence (EOS, the chat template's end of turn); None lets xgrammar take the
    tokenizer's EOS. The grammar allows a stop token exactly when its text is complete."""

    def __init__(self, tokenizer, vocab_size: int | None = None, *, stop_token_ids: list[int] | None = None,
                 max_threads: int = 2, cache_size: int = 256):
        from turnout.structured.grammar import import_xgrammar

        xgr = import_xgrammar()

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._init(info, max_threads, cache_size)

    @classmethod
    def from_tokenizer_info(cls, info, *, max_threads: int = 2, cache_size: int = 256) -> "GrammarCompiler":
        self = cls.__new__(cls)
        self._init(info, max_threads, cache_size)
        return self

    def _init(self, info, max_threads: int, cache_size: int) -> None:
        from turnout.structured.grammar import import_xgrammar

        xgr = import_xgrammar()

        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.tokenizer_info = info
        self.vocab_size = info.vocab_size
        self.stop_token_ids = list(info.stop_token_ids)
        # xgrammar's own cache is off: ours is keyed by the canonical constraint and bounded in entries.
        self._xgr = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._done: OrderedDict[tuple, object] = OrderedDict()
        self._in_flight: dict[tuple, Future] = {}
        self._hits = self._misses = 0

    def compile(self, params: StructuredOutputsParams):
        """The xgrammar CompiledGrammar of ``params`` (cached). Raises StructuredOutputsError naming the field."""
        key = params.cache_key()
        with self._lock:
            if key in self._done:
                self._hits += 1
                self._done.move_to_end(key)
                return self._done[key]
            waiting = self._in_flight.get(key)
            if waiting is None:
                self._misses += 1
                mine = self._in_flight[key] = Future()
            else:
                self._hits += 1  # served by the compilation in flight
        if waiting is not None:
            return waiting.result()  # re-raises the compiler's error for every waiter
        try:
            compiled = self._compile_uncached(params)
        except BaseException as e:
            with self._lock:
                del self._in_flight[key]
            mine.set_exception(e)
            raise
        with self._lock:
            del self._in_flight[key]
            self._done[key] = compiled
            while len(self._done) > self._cache_size:
                self._done.popitem(last=False)
        mine.set_result(compiled)
        return compiled

    def _compile_uncached(self, params: StructuredOutputsParams):
        grammar = build_grammar(params)
        try:
            return self._xgr.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise params.error(params.kind, f"could not compile for this vocabulary: {clean_error(e)}") from None

    async def compile_async(self, params: StructuredOutputsParams, executor=None):
        """compile() on a worker thread (``executor``, or the loop's default), so the event loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(executor, self.compile, params)

    def new_state(self, params_or_compiled) -> GrammarState:
        """A fresh matcher for one sequence (each of a request's n samples needs its own)."""
        compiled = (self.compile(params_or_compiled) if isinstance(params_or_compiled, StructuredOutputsParams)
                    else params_or_compiled)
        return GrammarState(compiled, self.vocab_size)

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._done))
