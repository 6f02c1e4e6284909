"""Fixtures of the structured-output tests: the embedded SmolLM2 tokenizer and a grammar compiler for it."""

from __future__ import annotations

import pytest
import torch

from turnout.ops import resolve
from turnout.platforms import detect_platform
from turnout.structured.compiler import GrammarCompiler

PAD = 64  # the logits are wider than the tokenizer: padding ids must never be drawn


@pytest.fixture(scope="session")
def tok():
    from turnout.loader.gguf import load_tokenizer
    from turnout.loader.source import default_model_path

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def compiler(tok):
    return GrammarCompiler(tok, vocab_size=len(tok) + PAD)


@pytest.fixture(scope="session")
def walk_tools(tok, compiler):
    v = compiler.vocab_size
    bias = torch.zeros(v)
    for i in range(len(tok)):
        text = tok.decode([i])
        if 0 < len(text.strip()) <= 2 and any(c in '{}[]",:0123456789' for c in text):
            bias[i] = 6.0
    for t in compiler.stop_token_ids:
        bias[t] = 12.0  # allowed only where the text is complete: then end soon
    table = resolve(detect_platform(), ops=["apply_token_bitmask"])
    return bias, table
