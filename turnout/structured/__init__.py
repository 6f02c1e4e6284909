"""Structured output (grammar-constrained decoding) with xgrammar.

- params.py: ``StructuredOutputsParams`` (vLLM's name and shape), validated on construction.
- grammar.py: params -> xgrammar Grammar (tokenizer-free; the validation).
- compiler.py: ``GrammarCompiler`` (one per tokenizer): compiled grammars, cached by canonical constraint,
  thread-safe, ``compile_async`` off the event loop.
- matcher.py: ``GrammarState`` (one per sequence): accept a token, fill its bitmask row, terminated,
  rollback, fork; ``fill_batch_bitmask`` for a batch.
- request.py: OpenAI ``response_format`` and vLLM's ``structured_outputs`` / ``guided_*`` -> params.
- mask.py: ``BitmaskStage``, the sampler's grammar stage (pinned double buffer, one copy, the op).

The mask is applied by the ``apply_token_bitmask`` op (turnout/ops/reference/bitmask.py).
"""

from turnout.structured.params import KINDS, StructuredOutputsError, StructuredOutputsParams

__all__ = ["KINDS", "StructuredOutputsError", "StructuredOutputsParams", "GrammarCompiler", "GrammarState",
           "allocate_bitmask", "fill_batch_bitmask", "from_request"]


def __getattr__(name):  # the xgrammar-backed pieces load on first use
    if name == "GrammarCompiler":
        from turnout.structured.compiler import GrammarCompiler
        return GrammarCompiler
    if name in ("GrammarState", "allocate_bitmask", "fill_batch_bitmask"):
        from turnout.structured import matcher
        return getattr(matcher, name)
    if name == "from_request":
        from turnout.structured.request import from_request
        return from_request
    raise AttributeError(name)
