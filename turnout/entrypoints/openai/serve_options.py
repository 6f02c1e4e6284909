"""What the serve flags decide about answers (tool calls, reasoning, the chat template, logprobs), checked
once at start-up so that a bad flag is an exit at once, never a failing request later.

``ServeOptions`` rides on ``ServerState.options``; the request handlers read it and nothing else of the
command line. ``refuse_remote_code(model)`` runs before the model loads: turnout builds every model from
its own code, so a checkpoint that needs the repository's Python (``auto_map`` for a model type
transformers does not know) is refused with that reason, ``--trust-remote-code`` or not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_LOGPROBS = 20


@dataclass(frozen=True)
class ServeOptions:
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a name of tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None  # a name of reasoning.REASONING_PARSERS
    chat_template: str | None = None  # Jinja text (the file already read), overriding the tokenizer's
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    grammar_timeout: float = 10.0  # seconds to build and compile a request's grammars (serving_grammar.py)

    def __post_init__(self):
        from turnout.engine.sampling_params import MAX_LOGPROBS
        from turnout.entrypoints.openai.reasoning import REASONING_PARSERS
        from turnout.entrypoints.openai.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser: unknown parser {self.tool_call_parser!r} "
                             f"(known: {', '.join(sorted(TOOL_PARSERS))})")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser (known: "
                             f"{', '.join(sorted(TOOL_PARSERS))})")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser: unknown parser {self.reasoning_parser!r} "
                             f"(known: {', '.join(sorted(REASONING_PARSERS))})")
        if not (isinstance(self.max_logprobs, int) and 0 <= self.max_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"--max-logprobs: must be in [0, {MAX_LOGPROBS}] (the engine returns at most "
                             f"{MAX_LOGPROBS} alternatives a token), got {self.max_logprobs}")
        if not self.grammar_timeout > 0:
            raise ValueError(f"--grammar-timeout: must be > 0 seconds, got {self.grammar_timeout}")
        if self.chat_template is not None:
            _check_template(self.chat_template)

    @property
    def auto_tools(self) -> bool:
        """Whether tool_choice "auto" can be served: a parser reads the model's own tool-call syntax."""
        return self.enable_auto_tool_choice and self.tool_call_parser is not None


def _check_template(text: str) -> None:
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment().parse(text)
    except ImportError:  # transformers needs jinja2 to render any template; nothing to check without it
        return
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError and friends
        raise ValueError(f"--chat-template: not a valid Jinja template: {e}") from None


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's path (read now), else the template itself. A value that looks like a
    path (no Jinja markup) but names no file is an error, not a one-line template."""
    if value is None:
        return None
    p = Path(value).expanduser()
    try:
        is_file = p.is_file()
    except OSError:  # a template longer than a file name may be
        is_file = False
    if is_file:
        try:
            return p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value!r}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def refuse_remote_code(model: str | None, trust_remote_code: bool) -> None:
    """A ValueError when the model's config needs code from the model's repository (turnout never runs
    it). Only a local directory or a Hub id already in the cache is read here; others are found by the
    loader, whose AutoConfig refuses the same config."""
    if model is None or Path(model).expanduser().is_file():
        return  # the embedded model or a .gguf file: no Python in either
    p = Path(model).expanduser()
    cfg_path = p / "config.json" if p.is_dir() else _cached_config(model)
    if cfg_path is None or not cfg_path.is_file():
        return
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # the loader reports a broken config
    auto_map = cfg.get("auto_map") if isinstance(cfg, dict) else None
    if not isinstance(auto_map, dict) or not auto_map:
        return
    from transformers import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return  # transformers has its own class for it; auto_map is not needed
    from turnout.loader.remote_configs import READ_AS

    if model_type in READ_AS:
        return  # read with a public transformers class (Kimi-K2: DeepseekV3Config); the loader checks its fields
    flag = "--trust-remote-code is accepted, but" if trust_remote_code else "and"
    raise ValueError(f"model {model!r}: its config needs the model repository's own code (auto_map: "
                     f"{', '.join(sorted(auto_map))}; model_type {model_type!r} is not one transformers "
                     f"knows), {flag} turnout never runs a model's code: it builds every model from its own "
                     f"implementation")


def _cached_config(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id: the loader says so
        return None
    return Path(found) if isinstance(found, str) else None
