"""Incremental detokenisation with stop strings, for one sample. No torch.

Text is produced by the prefix/read-offset window technique (as vLLM's ``detokenize_incrementally``):
each new token is decoded together with a few tokens before it, so that spaces and byte-level merges
come out as in a whole decode, and only the text past the already-read tokens is new:

    prefix_text = decode(ids[prefix_offset:read_offset]);  new_text = decode(ids[prefix_offset:])
    delta = new_text[len(prefix_text):]                     # then prefix_offset, read_offset move on

A decode that ends in U+FFFD (a UTF-8 character split across tokens) is held back, without moving the
offsets, until the character completes. The window starts on the last few prompt tokens, so the first
output token is decoded in context.

Stop strings are searched in the decoded text. Text that could still be the start of a stop string (the
longest tail of the text that is a proper prefix of one) is held back, so nothing of a stop string is
ever returned unless ``include_stop_str_in_output``. With ``include_stop_str_in_output`` nothing needs
holding back (the stop string is output either way) and the output ends at the end of the stop string.
"""

from __future__ import annotations

from typing import Any

# prompt tokens decoded before the first output token (spaces and merges at the junction)
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped: str | None = None  # the stop string that ended the text
        self.token_ids: list[int] = []  # output tokens added
        # The Rust tokenizer's decode is what the slow path does too, without ~15 us of Python around it;
        # only when the tokenizer cleans up spaces (a whole-text rewrite) go through tokenizer.decode.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode_fn = backend.decode
        else:
            self._decode_fn = tokenizer.decode
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._ids: list[int] = context  # decode window source: prompt context + output tokens
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._decoded = ""  # final output text (complete characters), before stop handling
        self._emitted = 0  # chars of _decoded returned so far
        self._stop_end: int | None = None  # where the output text ends once stopped
        self.text = ""  # everything returned so far by add() and flush()

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    # ---- public ---------------------------------------------------------------------------------
    def add(self, token_id: int, check_stop: bool = True) -> str:
        """Add one output token; return the text that became final. After a stop string, returns "".
        ``check_stop=False`` (e.g. before ``min_tokens``) does not look for stop strings that end in
        this token's text, but still holds back a possible start of one."""
        if self.stopped is not None:
            return ""
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # nothing new (a skipped special token) or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._advance(new_text[len(prefix_text) :], check_stop)

    def flush(self) -> str:
        """Release all held text (the sequence ended for another reason than a stop string), including an
        incomplete character's U+FFFD. Stop strings are still honoured."""
        if self.stopped is not None:
            return ""
        tail = ""
        if self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            tail = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        delta = self._advance(tail, True)
        if self.stopped is None:  # nothing can become a stop string any more
            delta += self._release(len(self._decoded))
        return delta

    @property
    def num_held_chars(self) -> int:
        """Decoded characters not returned yet (a possible start of a stop string)."""
        return len(self._decoded) - self._emitted

    # ---- internals ------------------------------------------------------------------------------
    def _release(self, end: int) -> str:
        delta = self._decoded[self._emitted : end]
        self._emitted = max(self._emitted, end)
        self.text += delta
        return delta

    def _advance(self, delta: str, check_stop: bool) -> str:
        old_len = len(self._decoded)
        self._decoded += delta
        if not self.stop:
            return self._release(len(self._decoded))
        if check_stop and delta:
            match = self._find_stop(old_len)
            if match is not None:
                pos, s = match
                self.stopped = s
                end = pos + len(s) if self.include_stop_str_in_output else pos
                return self._release(end)
        if self.include_stop_str_in_output:
            return self._release(len(self._decoded))
        return self._release(len(self._decoded) - self._held_tail())

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """The earliest (then longest) stop string that ends in the text added since ``old_len``."""
        text, best = self._decoded, None
        for s in self.stop:
            lo = max(0, old_len - len(s) + 1)
            if not self.include_stop_str_in_output:
                lo = max(lo, self._emitted)  # held-back text starts no later than any match
            pos = text.find(s, lo)
            if pos >= 0 and (best is None or (pos, -len(s)) < (best[0], -len(best[1]))):
                best = (pos, s)
        return best

    def _held_tail(self) -> int:
        """Length of the longest tail of the unreturned text that is a proper prefix of a stop string."""
        text, avail = self._decoded, len(self._decoded) - self._emitted
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, avail), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held


class NoTextDetokenizer:
    """The detokenizer of a model without a tokenizer: token ids only."""

    stopped = None

    def add(self, token_id: int, check_stop: bool = True) -> str:
        return ""

    def flush(self) -> str:
        return ""
