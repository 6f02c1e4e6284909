"""The reasoning parsers ``--reasoning-parser`` names (vLLM's names)."""

from __future__ import annotations

from turnout.entrypoints.openai.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 hybrid models write ``<think>`` ... ``</think>`` themselves (an output without ``<think>`` is all
    content); for Qwen3 thinking-only models, whose template ends the prompt with ``<think>``, pass
    ``opened_in_prompt=True`` (or ``opened_by_prompt(prompt)``)."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1's template ends the prompt with ``<think>\\n``: the output is reasoning until
    ``</think>`` (all reasoning if it never comes); a ``<think>`` the model repeats is dropped."""

    name = "deepseek_r1"
    default_opened = True
