"""Grammars compiled against the model's vocabulary, once per distinct constraint.

``GrammarCompiler`` wraps xgrammar's compiler for one tokenizer. ``compile(params)`` is thread-safe and
compiles each canonical constraint (``StructuredOutputsParams.cache_key``) once: concurrent callers with
the same key wait for the one compilation in flight; a finished one is kept in an LRU bounded both in
entries (``cache_size``) and in bytes (``cache_bytes``, from xgrammar's own ``memory_size_bytes``: one
compiled 20000-value enum holds 83 MB, so a bound by count alone lets distinct large grammars grow the
server without limit). It blocks (a large schema takes tens of milliseconds), so an event loop calls
``compile_async``, which runs it on a worker thread (the server: turnout/structured/workers.py, with a
deadline). A compiled grammar is also kept on its params (``attach``), so the engine's admission finds it
even after the cache has evicted it, and never compiles on the engine's thread what the server compiled.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from turnout.structured.grammar import clean_error
from turnout.structured.matcher import GrammarState, bitmask_words
from turnout.structured.params import StructuredOutputsParams


@dataclass
class CacheInfo:
    hits: int
    misses: int
    size: int
    bytes: int = 0  # the compiled grammars' own estimate of their memory


DEFAULT_CACHE_BYTES = 512 << 20  # compiled grammars a server keeps for reuse


class GrammarCompiler:
    """``tokenizer``: a Hugging Face tokenizer. ``vocab_size``: the width of the model's logits (an LM head
    is often padded past the tokenizer's vocabulary; the padding ids are never allowed). ``stop_token_ids``:
    the ids that end a sequence (EOS, the chat template's end of turn); None lets xgrammar take the
    tokenizer's EOS. The grammar allows a stop token exactly when its text is complete."""

    def __init__(self, tokenizer, vocab_size: int | None = None, *, stop_token_ids: list[int] | None = None,
                 max_threads: int = 2, cache_size: int = 256,
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        from turnout.structured.grammar import import_xgrammar

        xgr = import_xgrammar()

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._init(info, max_threads, cache_size, cache_bytes)

    @classmethod
    def from_tokenizer_info(cls, info, *, max_threads: int = 2, cache_size: int = 256,
                            cache_bytes: int = DEFAULT_CACHE_BYTES) -> "GrammarCompiler":
        self = cls.__new__(cls)
        self._init(info, max_threads, cache_size, cache_bytes)
        return self

    def _init(self, info, max_threads: int, cache_size: int, cache_bytes: int) -> None:
        from turnout.structured.grammar import import_xgrammar

        xgr = import_xgrammar()

        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self.tokenizer_info = info
        self.vocab_size = info.vocab_size
        self.stop_token_ids = list(info.stop_token_ids)
        # xgrammar's own cache is off: ours is keyed by the canonical constraint and bounded in entries.
        self._xgr = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._bytes = 0  # held by self._done
        self._lock = threading.Lock()
        self._done: OrderedDict[tuple, tuple[object, int]] = OrderedDict()  # key -> (compiled, bytes)
        self._in_flight: dict[tuple, Future] = {}
        self._hits = self._misses = 0

    def compile(self, params: StructuredOutputsParams):
        """The xgrammar CompiledGrammar of ``params`` (cached). Raises StructuredOutputsError naming the field."""
        attached = getattr(params, "_compiled", None)
        if attached is not None and attached[0] is self:
            return attached[1]
        key = params.cache_key()
        with self._lock:
            if key in self._done:
                self._hits += 1
                self._done.move_to_end(key)
                return self.attach(params, self._done[key][0])
            waiting = self._in_flight.get(key)
            if waiting is None:
                self._misses += 1
                mine = self._in_flight[key] = Future()
            else:
                self._hits += 1  # served by the compilation in flight
        if waiting is not None:
            return self.attach(params, waiting.result())  # re-raises the compiler's error for every waiter
        try:
            compiled = self._compile_uncached(params)
        except BaseException as e:
            with self._lock:
                del self._in_flight[key]
            mine.set_exception(e)
            raise
        size = _size(compiled)
        with self._lock:
            del self._in_flight[key]
            if size <= self._cache_bytes:  # one larger than the whole bound is used once, not kept
                self._done[key] = (compiled, size)
                self._bytes += size
                while len(self._done) > self._cache_size or self._bytes > self._cache_bytes:
                    self._bytes -= self._done.popitem(last=False)[1][1]
        mine.set_result(compiled)
        return self.attach(params, compiled)

    def attach(self, params: StructuredOutputsParams, compiled):
        """Keep ``compiled`` on ``params`` (the request holds its grammar whatever the cache evicts)."""
        params._compiled = (self, compiled)
        return compiled

    def _compile_uncached(self, params: StructuredOutputsParams):
        grammar = params.grammar_object()
        try:
            compiled = self._xgr.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise params.error(params.kind, f"could not compile for this vocabulary: {clean_error(e)}") from None
        self._check_productive(params, compiled)
        return compiled

    def _check_productive(self, params: StructuredOutputsParams, compiled) -> None:
        """A grammar that allows no first token and is not complete either (``root ::= root``: every rule
        refers back to itself with nothing to end it) could only be sampled from a row of -inf: refused
        here, where it is the client's mistake, rather than failing inside the engine."""
        state = GrammarState(compiled, self.vocab_size)
        row = torch.zeros((1, bitmask_words(self.vocab_size)), dtype=torch.int32)
        state.fill_bitmask(row, 0)
        if state.at_dead_end:
            raise params.error(params.kind, "the grammar allows no output at all (a rule that can only refer "
                                            "back to itself, such as root ::= root, never produces text)")

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
            return CacheInfo(self._hits, self._misses, len(self._done), self._bytes)


def _size(compiled) -> int:
    """xgrammar's estimate of a compiled grammar's memory (the token masks it precomputed)."""
    size = getattr(compiled, "memory_size_bytes", None)
    return int(size) if size is not None else 0
