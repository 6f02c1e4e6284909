"""Reasoning parsers: ``get_reasoning_parser(name, opened_in_prompt=None)``; ``extract_reasoning(text)`` for a
complete output, ``streaming()`` for a per-request streaming state. The server applies the reasoning parser
first and the tool parser to the content it leaves."""

from __future__ import annotations

from turnout.entrypoints.openai.reasoning.base import (
    ReasoningDelta,
    ReasoningParser,
    StreamingReasoningParser,
    assemble_reasoning,
)
from turnout.entrypoints.openai.reasoning.harmony import HarmonyReasoningParser
from turnout.entrypoints.openai.reasoning.parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "openai_gptoss": HarmonyReasoningParser,
}


def get_reasoning_parser(name: str, opened_in_prompt: bool | None = None) -> ReasoningParser:
    """A parser by name; an unknown name is a ValueError naming ``--reasoning-parser`` and the known ones."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r} (known: {', '.join(sorted(REASONING_PARSERS))})")
    return cls(opened_in_prompt)


__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "StreamingReasoningParser", "assemble_reasoning",
           "get_reasoning_parser"]
