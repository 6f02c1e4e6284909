"""Tool-call parsers, by the name ``--tool-call-parser`` takes (vLLM's names).

``get_tool_parser(name)`` returns a parser: ``extract_tool_calls(text)`` for a complete output,
``streaming()`` for a per-request streaming state (``feed(delta_text)``, ``finish()``). constrained.py turns
``tools`` + ``tool_choice`` ("required" or a named function) into structured output and parses what it
produces.
"""

from __future__ import annotations

import importlib

from turnout.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    ExtractedToolCalls,
    StreamingToolParser,
    ToolCall,
    ToolParser,
    assemble,
)

# name -> "module:class" under this package, imported when asked for
TOOL_PARSERS: dict[str, str] = {
    "hermes": "hermes:HermesToolParser",
    "llama3_json": "llama3_json:Llama3JsonToolParser",
    "mistral": "mistral:MistralToolParser",
    "openai": "openai:OpenAIToolParser",
}


def get_tool_parser(name: str) -> ToolParser:
    """A parser by name; an unknown name is a ValueError naming ``--tool-call-parser`` and the known ones."""
    target = TOOL_PARSERS.get(name)
    if target is None:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})")
    module, cls = target.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()


__all__ = ["TOOL_PARSERS", "DeltaMessage", "ExtractedToolCalls", "StreamingToolParser", "ToolCall", "ToolParser",
           "assemble", "get_tool_parser"]
